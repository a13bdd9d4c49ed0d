"""Learning-rate schedulers under MuonMixin, through a real Trainer, exact values: one scheduler per optimizer,
stepped once per update (or per epoch, or every ``frequency`` updates) as under automatic optimization, with the
fit's length in updates; ReduceLROnPlateau gets its metric (per epoch or per step) or fails naming it; a resumed
fit that is longer follows the new length, and a fixed schedule that runs out says so once.
"""

from __future__ import annotations

import functools
import warnings

import pytest
import torch
from lightning.pytorch.callbacks import (
    Callback,
)
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import nn

from lightning_muon import MuonMixin, WarmupCosine

from helpers import (
    ADAMW,
    LearningRates,
    MuonRegression,
    PlainRegression,
    Regression,
    make_trainer,
)


def step_lr_every_epoch(optimizer):
    return {"scheduler": torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5), "interval": "epoch"}


def test_an_epoch_interval_scheduler_steps_once_per_epoch(tmp_path):
    lrs = LearningRates()
    model = MuonRegression(lr_scheduler=step_lr_every_epoch)
    trainer = make_trainer(tmp_path, max_epochs=3, callbacks=[lrs])
    trainer.fit(model)
    assert trainer.global_step == 12
    assert lrs.lrs == [0.02] * 4 + [0.01] * 4 + [0.005] * 4  # Muon's lr: halved at each epoch end, not each update
    assert [c.scheduler.last_epoch for c in trainer.lr_scheduler_configs] == [3, 3]


def step_lr_every_second_batch(optimizer):
    return {"scheduler": torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5), "frequency": 2}


def test_a_step_scheduler_keeps_its_frequency_as_under_automatic_optimization(tmp_path):
    ours, theirs = LearningRates(), LearningRates()
    make_trainer(tmp_path, max_epochs=2, callbacks=[ours]).fit(
        MuonRegression(muon=None, adamw=ADAMW, lr_scheduler=step_lr_every_second_batch)
    )
    make_trainer(tmp_path, max_epochs=2, callbacks=[theirs]).fit(
        PlainRegression(lambda o: {**step_lr_every_second_batch(o), "interval": "step"})
    )
    assert ours.lrs == theirs.lrs == [0.01, 0.01, 0.005, 0.005, 0.0025, 0.0025, 0.00125, 0.00125]


def test_scheduler_steps_once_per_update_on_both_optimizers_with_total_from_the_trainer(tmp_path):
    model = MuonRegression(  # 32 batches, 8 updates an epoch with accumulation 4
        batch_size=2,
        samples=64,
        accumulate_grad_batches=4,
        lr_scheduler=functools.partial(WarmupCosine, warmup_steps=2),
    )
    fit = make_trainer(tmp_path, max_epochs=1)
    fit.fit(model)
    assert fit.global_step == 8
    for config, base_lr in zip(fit.lr_scheduler_configs, (0.02, 3e-4)):
        scheduler = config.scheduler
        assert scheduler.total_steps == 8  # trainer.estimated_stepping_batches counts updates
        assert scheduler.last_epoch == 8
        assert scheduler.optimizer.param_groups[0]["lr"] == pytest.approx(base_lr * scheduler.factor(8))
    assert fit.lr_scheduler_configs[0].scheduler.factor(8) == pytest.approx(0.0)


def test_a_schedule_needing_the_fit_length_on_an_unbounded_fit_is_an_actionable_error(tmp_path):
    model = MuonRegression(lr_scheduler=functools.partial(WarmupCosine, warmup_steps=2))
    with pytest.raises(MisconfigurationException, match=r"set Trainer\(max_steps=...\) or max_epochs"):
        make_trainer(tmp_path, max_epochs=-1).fit(model)


# ------------------------------------------------------------------ ReduceLROnPlateau


class ConstantMetric(Regression):
    """Logs a metric that never improves: ReduceLROnPlateau(patience=0) halves the lr from the second epoch on."""

    def training_step(self, batch, batch_idx):
        self.log("flat", 1.0, on_step=False, on_epoch=True)
        return super().training_step(batch, batch_idx)


class PlainConstantMetric(ConstantMetric, PlainRegression):
    pass


class MuonConstantMetric(MuonMixin, ConstantMetric):
    pass


def plateau(optimizer, monitor="flat", strict=True):
    scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, factor=0.5, patience=0)
    return {"scheduler": scheduler, "monitor": monitor, "strict": strict}


def test_reduce_lr_on_plateau_gets_its_metric_as_under_automatic_optimization(tmp_path):
    ours, theirs = LearningRates(), LearningRates()
    trainer = make_trainer(tmp_path, max_epochs=4, callbacks=[ours])
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*lr scheduler dict contains the key")  # no "keys ignored"
        trainer.fit(MuonConstantMetric(muon=None, adamw=ADAMW, lr_scheduler=plateau))
    make_trainer(tmp_path, max_epochs=4, callbacks=[theirs]).fit(PlainConstantMetric(plateau))
    assert ours.lrs == theirs.lrs == [0.01] * 8 + [0.005] * 4 + [0.0025] * 4
    assert trainer.lr_scheduler_configs[0].monitor == "flat"


class StepMetric(Regression):
    def training_step(self, batch, batch_idx):
        self.log("flat_step", 1.0, on_step=True, on_epoch=False)
        return super().training_step(batch, batch_idx)


class PlainStepMetric(StepMetric, PlainRegression):
    pass


class MuonStepMetric(MuonMixin, StepMetric):
    pass


class UpdateLearningRates(Callback):
    """The lr each update uses, read where it steps."""

    def __init__(self) -> None:
        self.lrs: list[float] = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.lrs.append(optimizer.param_groups[0]["lr"])


def test_a_step_interval_plateau_scheduler_steps_each_update_as_under_automatic_optimization(tmp_path):
    ours, theirs = UpdateLearningRates(), UpdateLearningRates()
    per_step = functools.partial(plateau, monitor="flat_step")
    make_trainer(tmp_path, max_epochs=2, callbacks=[ours]).fit(
        MuonStepMetric(muon=None, adamw=ADAMW, lr_scheduler=lambda o: {**per_step(o), "interval": "step"})
    )
    make_trainer(tmp_path, max_epochs=2, callbacks=[theirs]).fit(
        PlainStepMetric(lambda o: {**per_step(o), "interval": "step"})
    )
    assert ours.lrs == theirs.lrs == [0.01, 0.01] + [0.01 / 2**k for k in range(1, 7)]


def test_a_plateau_scheduler_without_its_metric_fails_naming_it(tmp_path):
    model = MuonConstantMetric(muon=None, lr_scheduler=functools.partial(plateau, monitor="val_loss"))
    with pytest.raises(MisconfigurationException, match=r"ReduceLROnPlateau monitors 'val_loss', which was not "
                                                         r"logged\. Logged metrics: \['flat', 'train_loss'"):
        make_trainer(tmp_path, max_epochs=2).fit(model)


def test_a_plateau_scheduler_needs_a_monitor(tmp_path):
    model = MuonRegression(lr_scheduler=functools.partial(torch.optim.lr_scheduler.ReduceLROnPlateau, patience=0))
    with pytest.raises(MisconfigurationException, match=r"ReduceLROnPlateau but names no metric to monitor: use "
                                                         r"lightning\.pytorch\.cli\.ReduceLROnPlateau"):
        make_trainer(tmp_path, max_epochs=1).fit(model)


# ------------------------------------------------------------------ a resumed fit of another length


def fit_then_resume(tmp_path, schedule, first: int, second: int) -> tuple[list[float], list[float]]:
    """Fit ``first`` updates, checkpoint, resume into a fit of ``second`` updates: Muon's lrs of both."""
    first_lrs, second_lrs = LearningRates(), LearningRates()
    trainer = make_trainer(tmp_path, max_steps=first, callbacks=[first_lrs])
    trainer.fit(MuonRegression(lr_scheduler=schedule))
    path = tmp_path / "first.ckpt"
    trainer.save_checkpoint(path)
    make_trainer(tmp_path, max_steps=second, callbacks=[second_lrs]).fit(
        MuonRegression(lr_scheduler=schedule), ckpt_path=path
    )
    return first_lrs.lrs, second_lrs.lrs


def test_an_extended_run_follows_the_new_fit_length_instead_of_training_at_lr_0(tmp_path):
    schedule = functools.partial(WarmupCosine, warmup_steps=2)
    with pytest.warns(UserWarning, match=r"checkpoint's schedule was 8 updates long, this fit is 16: the cosine now"):
        first, second = fit_then_resume(tmp_path, schedule, first=8, second=16)
    assert len(first) == 8 and len(second) == 8  # updates 9..16 ran after the resume
    # The resumed updates use the 16-update cosine from update 8 on (before: all 0.0).
    reference = WarmupCosine(torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.02), warmup_steps=2, total_steps=16)
    assert second == pytest.approx([0.02 * reference.factor(step) for step in range(8, 16)])
    assert min(second) > 0.0


def test_a_fixed_schedule_that_runs_out_says_so_once(tmp_path):
    schedule = functools.partial(WarmupCosine, warmup_steps=2, total_steps=8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, second = fit_then_resume(tmp_path, schedule, first=8, second=12)
    past_end = [w for w in caught if "past its total_steps=8" in str(w.message)]
    assert len(past_end) == 2  # once per optimizer's scheduler, not once per update
    assert "nothing trains" in str(past_end[0].message)
    assert second == [0.0] * 4  # the user's fixed schedule is kept, but no longer silently
