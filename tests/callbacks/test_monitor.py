"""MuonMonitor through a real Trainer and CSVLogger: exact keys at exact steps, values against SVD, each lr key
once beside Lightning's LearningRateMonitor."""

from __future__ import annotations

import functools
import logging
import math
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import LearningRateMonitor
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import nn

from lightning_muon import Muon, MuonMonitor
from lightning_muon.callbacks.monitor import lr_keys

from helpers import (
    TWO_SHAPES,
    EndProcessGroup,
    ForkedDDP,
    MuonRegression,
    PlainRegression,
    Regression,
    make_trainer,
    read_metrics,
)


class PlainMuon(Regression):
    """Automatic optimization, one lightning_muon.Muon over the two hidden matrices in unnamed groups."""

    def __init__(self, groups: int = 1) -> None:
        super().__init__()
        self.groups = groups

    def configure_optimizers(self):
        hidden = [self.net[0].weight, self.net[2].weight]
        params = [{"params": [p]} for p in hidden] if self.groups > 1 else hidden
        return Muon(params, lr=0.02)


def fit(
    tmp_path: Path, model: L.LightningModule, monitor: MuonMonitor, end_process_group: bool = False, **kwargs
) -> list[dict[str, str]]:
    extra = [EndProcessGroup()] if end_process_group else []  # spawned DDP ranks: see its docstring
    trainer = make_trainer(tmp_path, csv_dir=tmp_path, callbacks=[monitor, *extra], log_every_n_steps=50, **kwargs)
    trainer.fit(model)
    return read_metrics(tmp_path)


def logged(rows: list[dict[str, str]]) -> dict[int, set[str]]:
    """Step -> the keys that have a value at that step."""
    steps: dict[int, set[str]] = {}
    for row in rows:
        steps.setdefault(int(row["step"]), set()).update(k for k, v in row.items() if v and k != "step")
    return steps


DIAGNOSTICS = {"muon/orthogonality_error", "muon/orthogonality_error_max", "muon/update_rms"}
EFFECTIVE = {"muon/effective_lr_min", "muon/effective_lr_max"}
NAMED_LRS = {"lr-Muon/hidden", "lr-AdamW/head", "lr-AdamW/norms_and_biases"}


@pytest.mark.parametrize("muon", [None, torch.optim.Muon], ids=["lightning_muon.Muon", "torch.optim.Muon"])
def test_mixin_logs_exact_keys_at_exact_steps(tmp_path, muon):
    kwargs = {} if muon is None else {"muon": functools.partial(muon, lr=0.02, weight_decay=0.01)}
    rows = fit(tmp_path, MuonRegression(**TWO_SHAPES, **kwargs), MuonMonitor(log_every_n_steps=3), max_steps=10)
    assert logged(rows) == {2: NAMED_LRS | EFFECTIVE | DIAGNOSTICS, 5: NAMED_LRS | EFFECTIVE | DIAGNOSTICS,
                            8: NAMED_LRS | EFFECTIVE | DIAGNOSTICS}
    row = next(r for r in rows if r["step"] == "2")
    assert float(row["lr-Muon/hidden"]) == 0.02
    assert float(row["lr-AdamW/head"]) == 3e-4
    # Shapes 16x8 (tall: sqrt(16/8)) and 24x16 (tall: sqrt(24/16)) under the "original" rule.
    assert float(row["muon/effective_lr_max"]) == pytest.approx(0.02 * math.sqrt(2))
    assert float(row["muon/effective_lr_min"]) == pytest.approx(0.02 * math.sqrt(1.5))


def test_accumulation_logging_steps_count_updates(tmp_path):
    model = MuonRegression(**TWO_SHAPES, batch_size=2, accumulate_grad_batches=4)
    rows = fit(tmp_path, model, MuonMonitor(log_every_n_steps=2), max_steps=6)
    assert sorted(logged(rows)) == [1, 3, 5]


@pytest.mark.parametrize(
    ("groups", "expected"), [(1, {"lr-Muon"}), (2, {"lr-Muon/pg1", "lr-Muon/pg2"})], ids=["one", "two"]
)
def test_unnamed_groups_under_automatic_optimization(tmp_path, groups, expected):
    rows = fit(tmp_path, PlainMuon(groups), MuonMonitor(log_every_n_steps=2), max_steps=4)
    assert logged(rows) == {1: expected | EFFECTIVE | DIAGNOSTICS, 3: expected | EFFECTIVE | DIAGNOSTICS}


def test_lr_keys_follow_learning_rate_monitor_for_repeated_classes():
    w = [nn.Parameter(torch.zeros(2, 2)) for _ in range(3)]
    keys = lr_keys([torch.optim.AdamW([w[0]]), torch.optim.AdamW([{"params": [w[1]], "name": "a"}]), Muon([w[2]])])
    assert keys == [["lr-AdamW"], ["lr-AdamW-1/a"], ["lr-Muon"]]
    with pytest.raises(MisconfigurationException, match=r"several param groups named \['x'\]"):
        lr_keys([torch.optim.AdamW([{"params": [w[0]], "name": "x"}, {"params": [w[1]], "name": "x"}])])


def svd_error(O: torch.Tensor) -> float:
    s = torch.linalg.svdvals(O.double())
    return (s.square() - 1).square().mean().sqrt().item()


class UpdateCapture(L.Callback):
    """The update of every Muon matrix at the last step, recovered from the weights."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.before = {n: p.detach().clone() for n, p in pl_module.named_parameters()}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.after = {n: p.detach().clone() for n, p in pl_module.named_parameters()}


@pytest.mark.parametrize(
    ("ns_coefficients", "ns_steps", "band"),
    [
        ((1.5, -0.5, 0.0), 30, (0.0, 1e-3)),  # the classic cubic converges: orthogonal
        ((3.4445, -4.7750, 2.0315), 5, (0.2, 0.8)),  # the quintic plateaus by design
    ],
    ids=["cubic-30", "quintic-5"],
)
def test_logged_error_agrees_with_svd_of_the_update(tmp_path, ns_coefficients, ns_steps, band):
    muon = functools.partial(
        Muon, lr=0.02, weight_decay=0.0, ns_coefficients=ns_coefficients, ns_steps=ns_steps, ns_dtype=torch.float64
    )
    # 64 samples in batches of 8: on batches of 4 the 24x16 update keeps a singular value too small for the
    # cubic's 30 steps to bring to 1 (an error of 0.17), which is the iteration's limit, not the monitor's.
    model = MuonRegression(**TWO_SHAPES, muon=muon, samples=64, batch_size=8).double()
    capture = UpdateCapture()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        logger=CSVLogger(tmp_path, name="", version=""),
        callbacks=[MuonMonitor(log_every_n_steps=4, per_parameter=True), capture],
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        max_steps=4,
    )
    trainer.fit(model)
    row = next(r for r in read_metrics(tmp_path) if r["step"] == "3")
    errors = []
    for name in ("net.0.weight", "net.2.weight"):
        lr = model.optimizers()[0].optimizer.effective_lr(model.get_parameter(name))
        O = (capture.before[name] - capture.after[name]) / lr  # weight decay 0: the step is -lr * O
        expected = svd_error(O)
        assert float(row[f"muon/orthogonality_error/{name}"]) == pytest.approx(expected, abs=1e-6)
        errors.append(expected)
    assert band[0] <= min(errors) and max(errors) <= band[1], errors
    assert float(row["muon/orthogonality_error"]) == pytest.approx(sum(errors) / 2, abs=1e-6)
    assert float(row["muon/orthogonality_error_max"]) == pytest.approx(max(errors), abs=1e-6)


def test_one_newton_schulz_step_is_clearly_less_orthogonal(tmp_path):
    results = {}
    for steps in (1, 5):
        muon = functools.partial(Muon, lr=0.02, ns_steps=steps, ns_dtype=torch.float32)
        model = MuonRegression(**TWO_SHAPES, muon=muon)
        rows = fit(tmp_path / str(steps), model, MuonMonitor(log_every_n_steps=4), max_steps=4)
        results[steps] = float(next(r for r in rows if r["step"] == "3")["muon/orthogonality_error"])
    assert results[1] > results[5] + 0.2, results


@pytest.mark.parametrize("adjust_lr_fn", [None, "original", "match_rms_adamw", "spectral", "none"])
def test_effective_lr_equals_the_formula(tmp_path, adjust_lr_fn):
    muon = functools.partial(Muon, lr=0.01, adjust_lr_fn=adjust_lr_fn)
    model = MuonRegression(**TWO_SHAPES, muon=muon)
    rows = fit(tmp_path, model, MuonMonitor(log_every_n_steps=2, orthogonality=False), max_steps=2)
    row = next(r for r in rows if r["step"] == "1")
    formula = {
        None: lambda a, b: math.sqrt(max(1, a / b)),
        "original": lambda a, b: math.sqrt(max(1, a / b)),
        "match_rms_adamw": lambda a, b: 0.2 * math.sqrt(max(a, b)),
        "spectral": lambda a, b: math.sqrt(a / b),
        "none": lambda a, b: 1.0,
    }[adjust_lr_fn]
    lrs = [0.01 * formula(16, 8), 0.01 * formula(24, 16)]
    assert float(row["muon/effective_lr_min"]) == pytest.approx(min(lrs))
    assert float(row["muon/effective_lr_max"]) == pytest.approx(max(lrs))
    assert not DIAGNOSTICS & set(k for k, v in row.items() if v)


def test_diagnostics_are_recorded_on_logging_steps_only(tmp_path):
    diagnosed: list[tuple[int, list[str]]] = []

    class Diagnosed(L.Callback):
        """What Muon diagnosed in each update, read before the monitor (the next callback) uses and clears it."""

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            muon = pl_module.optimizers()[0].optimizer
            diagnosed.append((trainer.global_step, sorted(d.name for d in muon.diagnostics)))

    model = MuonRegression(**TWO_SHAPES)
    trainer = L.Trainer(
        accelerator="cpu", devices=1, logger=CSVLogger(tmp_path),
        callbacks=[Diagnosed(), MuonMonitor(log_every_n_steps=4)], enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False, max_steps=12,
    )
    trainer.fit(model)
    # Both matrices in updates 4, 8 and 12 (global_step 4, 8, 12 once each has stepped), nothing in the others.
    assert [(step, names) for step, names in diagnosed if names] == [
        (step, ["net.0.weight", "net.2.weight"]) for step in (4, 8, 12)
    ]
    assert len(diagnosed) == 12


def test_sample_limits_and_rotates_the_diagnosed_matrices(tmp_path):
    rows = fit(
        tmp_path, MuonRegression(**TWO_SHAPES), MuonMonitor(log_every_n_steps=1, per_parameter=True, sample=1),
        max_steps=4,
    )
    per_step = logged(rows)
    diagnosed = [sorted(k for k in per_step[s] if k.startswith("muon/orthogonality_error/")) for s in range(4)]
    assert diagnosed == [
        ["muon/orthogonality_error/net.0.weight"],
        ["muon/orthogonality_error/net.2.weight"],
        ["muon/orthogonality_error/net.0.weight"],
        ["muon/orthogonality_error/net.2.weight"],
    ]


def test_skipped_updates_are_logged(tmp_path):
    class NaNOnce(MuonRegression):
        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            return loss * float("nan") if batch_idx == 1 else loss

    with pytest.warns(UserWarning, match="skipped an update"):
        rows = fit(tmp_path, NaNOnce(), MuonMonitor(log_every_n_steps=2), max_steps=4)
    row = next(r for r in rows if r["step"] == "3" and r.get("lr-Muon/hidden"))
    assert float(row["muon/skipped_steps"]) == 1.0


ERRORS = [
    ({"log_every_n_steps": 0}, r"log_every_n_steps must be None or an int >= 1, got 0"),
    ({"log_every_n_steps": 2.5}, r"got 2\.5"),
    ({"sample": 0}, r"sample must be None or an int >= 1, got 0"),
]


@pytest.mark.parametrize(("kwargs", "pattern"), ERRORS)
def test_argument_errors(kwargs, pattern):
    with pytest.raises(MisconfigurationException, match=pattern):
        MuonMonitor(**kwargs)


def test_no_logger_is_an_actionable_error(tmp_path):
    trainer = L.Trainer(accelerator="cpu", logger=False, callbacks=[MuonMonitor()], max_steps=1,
                        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False)
    with pytest.raises(MisconfigurationException, match="pass logger=CSVLogger"):
        trainer.fit(MuonRegression(**TWO_SHAPES))


def test_no_muon_optimizer_warns_and_logs_learning_rates(tmp_path):
    with pytest.warns(UserWarning, match="found no Muon optimizer"):
        rows = fit(tmp_path, PlainRegression(), MuonMonitor(log_every_n_steps=2), max_steps=2)
    assert logged(rows) == {1: {"lr-AdamW"}}


def test_adamw_baseline_logs_learning_rates_without_a_warning(tmp_path, recwarn):
    rows = fit(tmp_path, MuonRegression(**TWO_SHAPES, muon=None), MuonMonitor(log_every_n_steps=2), max_steps=2)
    assert logged(rows) == {1: {"lr-AdamW/hidden", "lr-AdamW/head", "lr-AdamW/norms_and_biases"}}
    assert not [w for w in recwarn if "found no Muon optimizer" in str(w.message)]


def test_muon_monitor_beside_learning_rate_monitor_writes_each_lr_key_once(tmp_path, caplog):
    trainer = make_trainer(tmp_path, csv_dir=tmp_path, max_steps=6,
                           callbacks=[LearningRateMonitor(logging_interval="step"), MuonMonitor()])
    with caplog.at_level(logging.INFO):
        trainer.fit(MuonRegression(**TWO_SHAPES))
    rows = read_metrics(tmp_path)
    keys = [k for k in rows[0] if k.startswith("lr-")]
    assert keys == ["lr-AdamW/head", "lr-AdamW/norms_and_biases", "lr-Muon/hidden"]
    for key in keys:
        steps = [r["step"] for r in rows if r[key]]
        assert steps == [str(s) for s in range(6)], key  # one value per step: no duplicate rows
    assert [r for r in rows if r.get("muon/effective_lr_max")]  # the monitor's own keys are still there
    told = [r.getMessage() for r in caplog.records if "LearningRateMonitor" in r.getMessage()]
    assert told == ["MuonMonitor: LearningRateMonitor logs the lr-* keys, so MuonMonitor leaves them out of its rows."]


@pytest.mark.distributed
def test_two_process_ddp_logs_the_same_error_as_one_process(tmp_path):
    """2 ranks x batch 4 (gloo) see the same averaged gradients as 1 process x batch 8.

    fp32 Newton-Schulz keeps the two within float32 summation-order noise: tolerance 1e-4.
    """

    muon = functools.partial(Muon, lr=0.02, weight_decay=0.01, ns_dtype=torch.float32)
    torch.manual_seed(0)
    single = fit(
        tmp_path / "one", MuonRegression(**TWO_SHAPES, muon=muon, batch_size=8), MuonMonitor(log_every_n_steps=2),
        max_steps=4,
    )
    torch.manual_seed(0)
    ddp = fit(
        tmp_path / "ddp",
        MuonRegression(**TWO_SHAPES, muon=muon, batch_size=4),
        MuonMonitor(log_every_n_steps=2),
        max_steps=4,
        strategy=ForkedDDP(),
        devices=2,
        end_process_group=True,
    )
    for step in ("1", "3"):
        one = next(r for r in single if r["step"] == step and r.get("muon/orthogonality_error"))
        two = next(r for r in ddp if r["step"] == step and r.get("muon/orthogonality_error"))
        for key in DIAGNOSTICS | EFFECTIVE:
            assert float(two[key]) == pytest.approx(float(one[key]), abs=1e-4), key


NORMUON = {"muon/normuon_second_moment", "muon/normuon_row_scale_ratio"}


def test_normuon_logs_its_second_moment_and_how_unequally_it_scales_the_rows(tmp_path):
    muon = functools.partial(Muon, lr=0.02, normuon_beta2=0.95, ns_dtype=torch.float32)
    model = MuonRegression(**TWO_SHAPES, muon=muon)
    monitor = MuonMonitor(log_every_n_steps=3)
    trainer = make_trainer(tmp_path, csv_dir=tmp_path, callbacks=[monitor], log_every_n_steps=50, max_steps=6)
    trainer.fit(model)
    rows = read_metrics(tmp_path)
    assert logged(rows) == {2: NAMED_LRS | EFFECTIVE | DIAGNOSTICS | NORMUON,
                            5: NAMED_LRS | EFFECTIVE | DIAGNOSTICS | NORMUON}
    # The last row is read from the state the last step left: recompute it from there.
    optimizer = trainer.optimizers[0]
    moments = [optimizer.state[p]["normuon_second_moment"] for g in optimizer.param_groups for p in g["params"]]
    assert [tuple(v.shape) for v in moments] == [(16, 1), (24, 1)]  # one per neuron of the 16x8 and 24x16 layers
    scales = [1 / (v.sqrt() + 1e-8) for v in moments]
    row = next(r for r in rows if r["step"] == "5")
    assert float(row["muon/normuon_second_moment"]) == pytest.approx(torch.cat(moments).mean().item(), rel=1e-6)
    ratio = sum((s.max() / s.min()).item() for s in scales) / 2
    assert float(row["muon/normuon_row_scale_ratio"]) == pytest.approx(ratio, rel=1e-6)
    assert ratio > 1.05  # tall matrices' rows differ: the normalization does something


def test_plain_muon_logs_no_normuon_keys(tmp_path):
    rows = fit(tmp_path, MuonRegression(**TWO_SHAPES), MuonMonitor(log_every_n_steps=3), max_steps=3)
    assert not NORMUON & logged(rows)[2]
