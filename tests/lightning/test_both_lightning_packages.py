"""MuonMixin and MuonMonitor under either Lightning package: ``lightning.pytorch`` and the standalone
``pytorch_lightning`` (which ``lightning`` itself installs, and many libraries still build on).

The two packages define the same classes twice, so every ``isinstance`` check of the package must accept both.
Each test runs the same module, Trainer and callbacks under each package; where both run, the weights must agree
bit for bit.
"""

from __future__ import annotations

import types
from pathlib import Path

import lightning.pytorch
import pytest
import pytorch_lightning
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_muon import MuonMixin, MuonMonitor
from lightning_muon.lightning import _compat

from helpers import read_metrics

PACKAGES = [pytest.param(lightning.pytorch, id="lightning.pytorch"),
            pytest.param(pytorch_lightning, id="pytorch_lightning")]


def classes(pl: types.ModuleType) -> type:
    """A small regression LightningModule of package ``pl`` with MuonMixin, and a configure_optimizers of its own."""

    class Regression(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1))

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = nn.functional.mse_loss(self.net(x), y)
            self.log("train_loss", loss)
            return loss

        def train_dataloader(self):
            g = torch.Generator().manual_seed(0)
            x = torch.randn(64, 4, generator=g)
            return DataLoader(TensorDataset(x, x.sum(1, keepdim=True).sin()), batch_size=8)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    class MuonRegression(MuonMixin, Regression):
        pass

    return MuonRegression


def trainer(pl: types.ModuleType, root: Path, **kwargs) -> object:
    defaults = dict(accelerator="cpu", devices=1, max_epochs=2, logger=False, enable_checkpointing=False,
                    enable_progress_bar=False, enable_model_summary=False, default_root_dir=root)
    return pl.Trainer(**{**defaults, **kwargs})


def weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize(
    ("settings", "updates"),
    [
        (lambda pl: {"gradient_clip_val": 0.5, "accumulate_grad_batches": 2}, 8),  # 2 epochs of 8 batches, 2 each
        (lambda pl: {"callbacks": [pl.callbacks.GradientAccumulationScheduler({0: 2, 1: 4})]}, 4 + 2),
    ],
    ids=["trainer-flags", "accumulation-scheduler"],
)
def test_the_mixin_trains_the_same_weights_under_either_package(settings, updates, tmp_path):
    """The Trainer's clipping and accumulation flags, and the package's own GradientAccumulationScheduler (which
    Lightning refuses under manual optimization as "not supported"): the same updates and the same bits from
    either package."""
    results = {}
    for pl in (lightning.pytorch, pytorch_lightning):
        model, given = classes(pl)(), settings(pl)
        fit = trainer(pl, tmp_path / pl.__name__, **given)
        fit.fit(model)
        assert fit.global_step == updates
        assert all(c in fit.callbacks for c in given.get("callbacks", []))  # the scheduler is given back
        results[pl.__name__] = weights(model)
    assert same(*results.values())


@pytest.mark.parametrize("pl", PACKAGES)
def test_swa_and_lr_find_of_either_package_are_refused_with_the_mixins_reason(pl, tmp_path):
    model = classes(pl)()
    swa = trainer(pl, tmp_path / "swa", callbacks=[pl.callbacks.StochasticWeightAveraging(swa_lrs=0.01)])
    with pytest.raises(Exception, match=r"StochasticWeightAveraging works with one optimizer and MuonMixin"):
        swa.fit(model)
    finder = trainer(pl, tmp_path / "lr_find", callbacks=[pl.callbacks.LearningRateFinder()])
    with pytest.raises(Exception, match=r"lr_find \(LearningRateFinder\) sweeps the learning rate of one optimizer"):
        finder.fit(model)


@pytest.mark.parametrize("pl", PACKAGES)
def test_fsdp1_and_deepspeed_of_either_package_are_refused_at_fit_start(pl):
    """FSDPStrategy needs a GPU to run at all and DeepSpeedStrategy DeepSpeed to be built (an instance whose
    constructor did not run stands for it), so the check is called as Lightning calls it, with the strategy set."""
    deepspeed = pl.strategies.DeepSpeedStrategy.__new__(pl.strategies.DeepSpeedStrategy)
    for strategy, refused in [(pl.strategies.FSDPStrategy(), r"strategy='fsdp'.*ModelParallelStrategy"),
                              (deepspeed, r"under DeepSpeed \(DeepSpeedStrategy\).*ModelParallelStrategy")]:
        model = classes(pl)()
        model.trainer = types.SimpleNamespace(strategy=strategy, state=types.SimpleNamespace(fn="fit"))
        with pytest.raises(Exception, match=refused):
            model.configure_callbacks()


@pytest.mark.parametrize("pl", PACKAGES)
def test_the_monitor_logs_under_either_package_and_sees_its_lr_monitor(pl, tmp_path):
    """MuonMonitor's keys through the package's CSVLogger; with the package's LearningRateMonitor present, the
    monitor leaves the learning rates to it (each lr value is logged once, as by LearningRateMonitor alone)."""

    def fit(directory: Path, callbacks: list) -> list[dict[str, str]]:
        logger = pl.loggers.CSVLogger(directory, name="", version="")
        trainer(pl, directory, max_epochs=1, logger=logger, log_every_n_steps=1, callbacks=callbacks).fit(
            classes(pl)()
        )
        return read_metrics(directory)

    rows = fit(tmp_path / "both", [MuonMonitor(log_every_n_steps=1), pl.callbacks.LearningRateMonitor()])
    alone = fit(tmp_path / "alone", [pl.callbacks.LearningRateMonitor()])
    assert sorted(rows[0]) == [
        "epoch", "lr-AdamW/head", "lr-AdamW/input", "lr-AdamW/norms_and_biases", "lr-Muon/hidden",
        "muon/effective_lr_max",
        "muon/effective_lr_min", "muon/orthogonality_error", "muon/orthogonality_error_max", "muon/update_rms",
        "step", "train_loss",
    ]
    for key in ("lr-Muon/hidden", "lr-AdamW/head", "lr-AdamW/input"):
        assert sum(bool(r[key]) for r in rows) == sum(bool(r[key]) for r in alone) > 0, key
    assert sum(bool(r["muon/orthogonality_error"]) for r in rows) == 8  # one per update


def test_the_classes_of_the_standalone_package_are_added_only_when_it_is_loaded():
    from lightning.pytorch.callbacks import GradientAccumulationScheduler

    both = _compat.lightning_classes(GradientAccumulationScheduler)
    assert both == (GradientAccumulationScheduler, pytorch_lightning.callbacks.GradientAccumulationScheduler)
    assert _compat._copies(GradientAccumulationScheduler, False) == (GradientAccumulationScheduler,)
    assert _compat.is_lightning_module_base(pytorch_lightning.LightningModule)
    assert _compat.is_lightning_module_base(nn.Module)
    assert not _compat.is_lightning_module_base(classes(pytorch_lightning))


@pytest.mark.parametrize("pl", PACKAGES)
def test_a_resumed_fit_under_either_package_equals_the_uninterrupted_one(pl, tmp_path):
    """The routing record and the loop's counters go through the package's own checkpointing."""
    straight = classes(pl)()
    trainer(pl, tmp_path / "straight").fit(straight)
    first = classes(pl)()
    fit = trainer(pl, tmp_path / "first", max_epochs=1)
    fit.fit(first)
    fit.save_checkpoint(tmp_path / "epoch1.ckpt")
    resumed = classes(pl)()
    trainer(pl, tmp_path / "resumed").fit(resumed, ckpt_path=tmp_path / "epoch1.ckpt")
    assert same(weights(resumed), weights(straight))


@pytest.mark.parametrize("pl", PACKAGES)
def test_micro_batches_before_the_last_skip_the_gradient_sync_of_either_packages_ddp(pl):
    """Under DDP of either package, the backward of a micro-batch that does not end an update runs inside the
    strategy's ``block_backward_sync`` (no all-reduce until the last one)."""
    from lightning_muon.lightning._update_loop import _no_gradient_sync

    entered = []

    class RecordingDDP(pl.strategies.DDPStrategy):
        def block_backward_sync(self):
            entered.append(type(self).__mro__[1].__module__)
            return super().block_backward_sync()

    module = types.SimpleNamespace(modules=lambda: [], trainer=types.SimpleNamespace(strategy=RecordingDDP()))
    with _no_gradient_sync(module):
        pass
    assert entered == [pl.strategies.DDPStrategy.__module__]
