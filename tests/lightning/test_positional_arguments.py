"""A parent's positional arguments: ``MuonSized(16, 2)`` passes them through the mixin to the parent, they are
saved as the parent's hyperparameters exactly as without the mixin (by the names of its parameters), and a
checkpoint of a few steps through a real Trainer loads back to the same model, with ``load_from_checkpoint`` and
through LightningCLI, as the parent's does.
"""

from __future__ import annotations

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_muon import MuonMixin

from helpers import make_trainer, same, snapshot


class Sized(L.LightningModule):
    """Most modules take their sizes (or their config) positionally."""

    def __init__(self, width: int, classes: int, depth: int = 1) -> None:
        super().__init__()
        self.save_hyperparameters()
        with torch.random.fork_rng():
            torch.manual_seed(0)
            layers: list[nn.Module] = [nn.Linear(8, width), nn.Tanh()]
            for _ in range(depth):
                layers += [nn.Linear(width, width), nn.Tanh()]
            self.net = nn.Sequential(*layers, nn.Linear(width, classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self(x), y)

    def train_dataloader(self):
        x = torch.randn(16, 8, generator=torch.Generator().manual_seed(0))
        return DataLoader(TensorDataset(x, (x.sum(1) > 0).long()), batch_size=4)


class MuonSized(MuonMixin, Sized):
    pass


class SavesNothing(Sized):
    """A parent that saves no hyperparameters itself: the mixin saves the plain ones, positional ones by name."""

    def __init__(self, width: int, classes: int, depth: int = 1) -> None:
        super().__init__(width, classes, depth)
        self.hparams.clear()  # as if the parent's __init__ had not called save_hyperparameters


class MuonSavesNothing(MuonMixin, SavesNothing):
    pass


def fitted(tmp_path, model: L.LightningModule) -> str:
    """Two updates through a real Trainer, then a checkpoint."""
    trainer = make_trainer(tmp_path, max_steps=2)
    trainer.fit(model)
    assert trainer.global_step == 2
    path = str(tmp_path / "model.ckpt")
    trainer.save_checkpoint(path)
    return path


def same_model(loaded: L.LightningModule, model: L.LightningModule) -> bool:
    x = torch.randn(5, 8)
    return type(loaded) is type(model) and same(snapshot(loaded), snapshot(model)) and torch.equal(loaded(x), model(x))


def test_positional_arguments_reach_the_parent_and_are_saved_as_its_own(tmp_path):
    model = MuonSized(16, 2, gradient_clip_val=0.5)
    parent = Sized(16, 2)
    assert model.net[-1].out_features == 2 and same(snapshot(model), snapshot(parent))
    assert {k: model.hparams[k] for k in parent.hparams} == dict(parent.hparams) == {"width": 16, "classes": 2,
                                                                                      "depth": 1}
    assert model.hparams["gradient_clip_val"] == 0.5  # the mixin's own settings beside them
    path = fitted(tmp_path, model)

    loaded = MuonSized.load_from_checkpoint(path, weights_only=True)
    assert same_model(loaded, model)
    assert dict(loaded.hparams) == dict(model.hparams) and loaded._muon_config == model._muon_config
    as_parent = Sized.load_from_checkpoint(path, weights_only=True)  # loads wherever the parent's checkpoint does
    assert dict(as_parent.hparams) == dict(parent.hparams)
    assert same(snapshot(as_parent), snapshot(model))


def test_positional_arguments_are_saved_by_name_where_the_parent_saves_nothing(tmp_path):
    model = MuonSavesNothing(16, 2, 2)
    assert {k: model.hparams[k] for k in ("width", "classes", "depth")} == {"width": 16, "classes": 2, "depth": 2}
    path = fitted(tmp_path, model)
    loaded = MuonSavesNothing.load_from_checkpoint(path, weights_only=True)
    assert same_model(loaded, model) and len(loaded.net) == 7


def test_the_parents_arguments_through_lightning_cli(tmp_path):
    from lightning_muon.commands.lightning_cli import instantiate

    cli = instantiate(["--model", f"{__name__}.MuonSized", "--model.width=16", "--model.classes=2",
                       "--model.gradient_clip_val=0.5", "--trainer.logger=false", "--trainer.max_steps=2",
                       "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false",
                       "--trainer.enable_checkpointing=false", f"--trainer.default_root_dir={tmp_path}"])
    cli.trainer.fit(cli.model)
    path = str(tmp_path / "cli.ckpt")
    cli.trainer.save_checkpoint(path)
    by_hand = MuonSized(16, 2, gradient_clip_val=0.5)
    fitted(tmp_path / "by_hand", by_hand)
    assert same(snapshot(cli.model), snapshot(by_hand))  # the same model as built positionally, trained the same
    loaded = MuonSized.load_from_checkpoint(path, weights_only=True)
    assert same_model(loaded, cli.model) and loaded._muon_config == cli.model._muon_config
    assert {k: loaded.hparams[k] for k in ("width", "classes", "depth")} == {"width": 16, "classes": 2, "depth": 1}
