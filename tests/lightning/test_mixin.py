"""MuonMixin on whole models, through a real Trainer, and as a class.

Lightning's ``BoringModel`` (with a hidden layer) and demo Transformer train with Muon and AdamW, each on exactly
the parameters routed to it, every parameter moving; the mixin must come first and leave
``configure_optimizers`` to itself (refused when the class is defined, with the fix), and adds three prefixed
attributes to the module and no more.
"""

from __future__ import annotations

from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.demos import LightningTransformer
from lightning.pytorch.demos.boring_classes import BoringModel, RandomDataset
from torch import nn
from torch.utils.data import DataLoader, Dataset

from lightning_muon import Muon, MuonMixin

from helpers import (
    MuonRegression,
    Recorder,
    Regression,
    make_trainer,
)


class DeepBoring(BoringModel):
    """Lightning's BoringModel with a hidden layer, so Muon has a matrix to own."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 2))

    def train_dataloader(self):
        return DataLoader(RandomDataset(32, 64), batch_size=2)


class MuonBoring(MuonMixin, DeepBoring):
    pass


def names_in(optimizer: torch.optim.Optimizer) -> set[str]:
    return {name for group in optimizer.param_groups for name in group["param_names"]}


def test_boring_model_both_optimizers_step_every_parameter_moves(tmp_path):
    torch.manual_seed(0)
    model = MuonBoring()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    fit = make_trainer(tmp_path, csv_dir=tmp_path, max_steps=5, num_sanity_val_steps=2)  # BoringModel validates
    fit.fit(model)

    muon, adamw = (o.optimizer for o in model.optimizers())
    assert isinstance(muon, Muon) and isinstance(adamw, torch.optim.AdamW)
    assert names_in(muon) == {"layer.2.weight"}  # layer.0 reads the batch: the input layer, on AdamW
    assert names_in(adamw) == {"layer.0.weight", "layer.0.bias", "layer.2.bias", "layer.4.weight", "layer.4.bias"}
    assert adamw.defaults["fused"] is True
    for name, p in model.named_parameters():
        assert not torch.equal(p.detach(), before[name]), f"{name} did not move"
    # Each optimizer has state for exactly its own parameters.
    assert len(muon.state) == 1 and len(adamw.state) == 5
    assert fit.global_step == 5


class TextWindows(Dataset):
    """Byte-level (input, target) windows of real text: this test file's own source, offline."""

    def __init__(self, length: int = 24, count: int = 64) -> None:
        data = torch.tensor(list(Path(__file__).read_bytes()), dtype=torch.long)
        self.windows = [data[i : i + length + 1] for i in range(0, count * length, length)]

    def __len__(self) -> int:
        return len(self.windows)

    def __getitem__(self, i):
        return self.windows[i][:-1], self.windows[i][1:]


class MuonTransformer(MuonMixin, LightningTransformer):
    def prepare_data(self) -> None:  # the demo downloads WikiText-2; we train on local text
        pass

    def train_dataloader(self):
        return DataLoader(TextWindows(), batch_size=8)


def test_demo_transformer_trains_with_muon_and_adamw(tmp_path, caplog):
    torch.manual_seed(0)
    model = MuonTransformer(vocab_size=256)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    recorder = Recorder()
    # Its configure_optimizers is replaced, and its lr with it: said once, as a warning saying where to change it.
    with pytest.warns(UserWarning) as record:
        make_trainer(tmp_path, csv_dir=tmp_path, max_steps=16, callbacks=[recorder]).fit(model)
    replaced = [str(w.message) for w in record if "configure_optimizers is replaced" in str(w.message)]
    assert replaced == [
        "LightningTransformer.configure_optimizers is replaced by MuonMixin's: it would have built SGD(lr=0.1) on "
        "67 tensors; MuonMixin trains with Muon(lr=0.02) on 20 tensors and AdamW(lr=0.0003) on 47 tensors. Ignored: "
        "its lr (0.1) is not used: give the lrs to train at (muon=..., adamw=...), or parent_lr=True to train at the "
        "parent's lr and weight decay (AdamW at them, Muon at them with adjust_lr_fn='match_rms_adamw')."
    ]

    muon, adamw = (o.optimizer for o in model.optimizers())
    routing = model.muon_routing()
    assert names_in(muon) == set(routing.names("Muon"))
    assert names_in(adamw) == set(routing.names("AdamW"))
    assert {"model.decoder.weight", "model.embedding.weight"} <= names_in(adamw)
    assert "model.transformer.encoder.layers.0.linear1.weight" in names_in(muon)
    for name, p in model.named_parameters():
        assert not torch.equal(p.detach(), before[name]), f"{name} did not move"
    first, last = sum(recorder.losses[:3]) / 3, sum(recorder.losses[-3:]) / 3
    assert last < first - 0.5, recorder.losses


# ------------------------------------------------------------------ the class


def test_mixin_after_the_parent_fails_at_class_definition_with_the_fix():
    with pytest.raises(TypeError, match="MuonMixin must come first") as error:

        class Bad(Regression, MuonMixin):
            pass

    message = str(error.value)
    assert "Regression defines training_step" in message
    assert "class Bad(MuonMixin, Regression):" in message


def test_subclass_defining_configure_optimizers_fails_at_class_definition():
    with pytest.raises(TypeError, match=r"Bad defines configure_optimizers.*muon=\.\.\., adamw=\.\.\."):

        class Bad(MuonMixin, Regression):
            def configure_optimizers(self):
                return torch.optim.SGD(self.parameters(), lr=0.1)

    with pytest.raises(TypeError, match="BadChild defines configure_optimizers"):  # further down, too

        class BadChild(MuonRegression):
            def configure_optimizers(self):
                return torch.optim.SGD(self.parameters(), lr=0.1)


MIXIN_ATTRIBUTES = {"_muon_config", "_muon_loop", "_muon_roles", "_muon_pair", "_muon_fit"}


def test_the_mixin_adds_five_prefixed_attributes_to_the_module_and_no_more(tmp_path):
    """The user's module keeps its own namespace: the mixin's state is `_muon_config`, `_muon_loop`, what the
    first batch showed (`_muon_roles`), the optimizer pair it last built (`_muon_pair`, kept after the fit for its
    checkpoints) and the fit's `_muon_fit`, set only during a fit (besides what Lightning's own save_hyperparameters
    writes, which the mixin calls)."""
    # The private names are what this test is about: the module's namespace, not the mixin's behaviour.
    plain, model = DeepBoring(), MuonBoring()
    plain.save_hyperparameters({"lr": 0.1})
    assert set(vars(model)) - set(vars(plain)) == MIXIN_ATTRIBUTES
    assert model._muon_fit is None

    class Spy(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            fits.append(pl_module._muon_fit)

    fits: list = []
    make_trainer(tmp_path, max_steps=3, callbacks=[Spy()]).fit(model)
    make_trainer(tmp_path / "plain", max_steps=3).fit(plain)
    assert set(vars(model)) - set(vars(plain)) == MIXIN_ATTRIBUTES
    assert len(fits) == 3 and fits[0] is not None and all(f is fits[0] for f in fits)  # one state for the fit
    assert model._muon_fit is None  # dropped at teardown
    assert list(model._muon_pair.optimizers.values()) == [o.optimizer for o in model.optimizers()]
