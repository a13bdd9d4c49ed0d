"""``MuonMixin(parent_lr=True)``: the parent's learning rate and weight decay (its first optimizer's), AdamW at them
and Muon at them with ``adjust_lr_fn="match_rms_adamw"``; refused clearly where there is nothing to read."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_muon import MuonMixin

from helpers import make_trainer


class NoOptimizer(L.LightningModule):
    """A module that leaves the optimizer to its user."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def train_dataloader(self):
        x = torch.randn(32, 4, generator=torch.Generator().manual_seed(0))
        return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8)


class Probe(NoOptimizer):
    """A library's module with its own tuned optimizer."""

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.003, momentum=0.9, weight_decay=0.01)


class MuonProbe(MuonMixin, Probe):
    pass


class MuonNoOptimizer(MuonMixin, NoOptimizer):
    pass


def test_the_parents_lr_and_weight_decay_reach_both_optimizers(tmp_path):
    model = MuonProbe(parent_lr=True)
    assert model.hparams["parent_lr"] is True
    trainer = make_trainer(tmp_path, max_steps=2)
    trainer.fit(model)
    muon, adamw = trainer.optimizers
    assert [(g["lr"], g["weight_decay"], g["adjust_lr_fn"]) for g in muon.param_groups] == [
        (0.003, 0.01, "match_rms_adamw")
    ]
    assert {(g["lr"], g["weight_decay"]) for g in adamw.param_groups} == {(0.003, 0.01)}
    lrs = model.muon_effective_lrs()  # what inspect shows: the same optimizers' numbers
    assert lrs["net.4.weight"] == 0.003
    assert lrs["net.2.weight"] == pytest.approx(0.003 * 0.2 * 16**0.5)  # match_rms_adamw: 0.2 * sqrt(max(m, n))


def test_without_it_the_mixins_own_lrs_train():
    model = MuonProbe()
    assert model.hparams["parent_lr"] is False
    assert model.muon_effective_lrs()["net.4.weight"] == 3e-4


def test_parent_lr_is_refused_where_there_is_nothing_to_read(tmp_path):
    with pytest.raises(MisconfigurationException, match=r"parent_lr=True, but no class of MuonNoOptimizer defines "
                                                        r"configure_optimizers"):
        make_trainer(tmp_path, max_steps=1).fit(MuonNoOptimizer(parent_lr=True))
    with pytest.raises(ValueError, match=r"parent_lr must be True or False, got 'yes'"):
        MuonProbe(parent_lr="yes")


def test_a_checkpoint_rebuilds_with_parent_lr(tmp_path):
    trainer = make_trainer(tmp_path, max_steps=2)
    trainer.fit(MuonProbe(parent_lr=True))
    trainer.save_checkpoint(tmp_path / "probe.ckpt")
    loaded = MuonProbe.load_from_checkpoint(tmp_path / "probe.ckpt", weights_only=True)
    assert loaded.hparams["parent_lr"] is True and loaded.muon_effective_lrs()["net.4.weight"] == 0.003
