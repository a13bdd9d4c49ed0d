"""Settings and situations that used to train silently wrong: each is now refused or corrected, loudly.

Through a real Trainer on a tiny regression model: impossible Muon settings are refused before training, and
a run extended from a checkpoint (a larger ``max_steps``) keeps a learning rate instead of training at 0.
"""

from __future__ import annotations

import functools
import re
import warnings

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_muon import Muon, MuonMixin, WarmupCosine

from helpers import make_trainer


class Regression(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        with torch.random.fork_rng():
            torch.manual_seed(0)
            self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        x = torch.randn(32, 8, generator=g)
        return DataLoader(TensorDataset(x, x.sum(1, keepdim=True).sin()), batch_size=4)  # 8 batches an epoch


class MuonRegression(MuonMixin, Regression):
    pass


class LearningRates(Callback):
    """Muon's lr at every update (before the step, as the update uses it)."""

    def __init__(self) -> None:
        self.lrs: list[float] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.lrs.append(trainer.optimizers[0].param_groups[0]["lr"])


@pytest.mark.parametrize(
    ("muon", "pattern"),
    [
        ({"momentum": 1.0}, r"Invalid momentum value: 1\.0 \(must be in \[0, 1\)"),
        ({"momentum": 1.5}, r"Invalid momentum value: 1\.5 \(must be in \[0, 1\)"),
        ({"ns_steps": 0}, r"Invalid ns_steps: 0 \(must be an int in \[1, 100\)"),
    ],
    ids=["momentum-1", "momentum-1.5", "ns_steps-0"],
)
def test_settings_that_cannot_train_are_refused_before_the_first_update(tmp_path, muon, pattern):
    model = MuonRegression(muon=functools.partial(Muon, lr=0.02, **muon))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(ValueError, match=r"could not build the `muon` optimizer .*" + pattern):
        make_trainer(tmp_path, max_steps=4).fit(model)
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters())


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


def test_weights_made_non_finite_by_an_update_stop_the_fit_naming_them(tmp_path):
    """Finite gradients, an AdamW lr of 1e38: the first update makes the AdamW weights inf."""
    model = MuonRegression(adamw=functools.partial(torch.optim.AdamW, lr=1e38))
    with pytest.raises(RuntimeError, match=r"turned weights non-finite, from finite gradients: net\.4\.weight "
                                           r"\(AdamW, lr 1e\+38\).*lower it"):
        make_trainer(tmp_path, max_steps=3).fit(model)
    assert model.trainer.global_step == 1  # stopped in the update that made them, not steps later


class NaNLoss(MuonRegression):
    def training_step(self, batch, batch_idx):
        return super().training_step(batch, batch_idx) * float("nan")


def test_16_mixed_with_every_update_skipped_by_the_scaler_stops_instead_of_completing(tmp_path):
    from lightning.pytorch.plugins.precision import MixedPrecision

    scaler = torch.amp.GradScaler("cpu")  # the default initial scale, 2**16
    model = NaNLoss()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer = make_trainer(tmp_path, max_steps=200, plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)])
    with pytest.warns(UserWarning, match=r"GradScaler skipped 5 updates in a row"):  # noqa: SIM117
        with pytest.raises(RuntimeError, match=r"skipped the last 17 updates and its scale fell to 0\.5.*the loss "
                                               r"itself is NaN"):
            trainer.fit(model)
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters())  # nothing moved, and it says so


class PlainAdamW(Regression):
    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def test_a_checkpoint_without_the_routing_record_is_refused_with_the_way_to_start_fresh(tmp_path):
    plain = make_trainer(tmp_path, max_steps=2)
    plain.fit(PlainAdamW())
    path = tmp_path / "plain.ckpt"
    plain.save_checkpoint(path)
    foreign = r"(?s)1 optimizer state\(s\) but no MuonMixin routing record.*load_state_dict"
    with pytest.raises(MisconfigurationException, match=foreign):
        make_trainer(tmp_path, max_steps=4).fit(MuonRegression(), ckpt_path=path)
    # The way the message gives: its weights, fresh optimizers.
    model = MuonRegression()
    model.load_state_dict(torch.load(path, weights_only=True)["state_dict"])
    trainer = make_trainer(tmp_path, max_steps=2)
    trainer.fit(model)
    assert trainer.global_step == 2
    # Loading only the weights through load_from_checkpoint is no resume: allowed.
    MuonRegression.load_from_checkpoint(path, weights_only=True)


def test_a_model_with_every_parameter_frozen_says_so(tmp_path):
    model = MuonRegression()
    model.requires_grad_(False)
    frozen = r"MuonRegression has no trainable parameter: every parameter has requires_grad=False"
    with pytest.raises(MisconfigurationException, match=frozen):
        make_trainer(tmp_path, max_steps=2).fit(model)


@pytest.mark.parametrize("keep", [0.0, 0.5], ids=["empty", "truncated"])
def test_an_unreadable_checkpoint_file_is_named_with_the_fix(tmp_path, keep):
    trainer = make_trainer(tmp_path, max_steps=2)
    trainer.fit(MuonRegression())
    whole = tmp_path / "whole.ckpt"
    trainer.save_checkpoint(whole)
    broken = tmp_path / "broken.ckpt"
    data = whole.read_bytes()
    broken.write_bytes(data[: int(len(data) * keep)])
    with pytest.raises(RuntimeError, match=rf"{re.escape(str(broken))} is not a complete checkpoint \(\d[\d,]* bytes;"):
        make_trainer(tmp_path, max_steps=4).fit(MuonRegression(), ckpt_path=broken)
    # The wrapper changes nothing for a good file.
    resumed = make_trainer(tmp_path, max_steps=4)
    resumed.fit(MuonRegression(), ckpt_path=whole)
    assert resumed.global_step == 4
