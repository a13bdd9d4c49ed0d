"""MuonMixin through a real Trainer: routing into both optimizers, update counting, accumulation, clipping."""

from __future__ import annotations

import functools
import json
import logging
import warnings
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.demos import LightningTransformer
from lightning.pytorch.demos.boring_classes import BoringModel, RandomDataset
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

from lightning_muon import Muon, MuonMixin, WarmupCosine
from lightning_muon.lightning import _checkpoint

from helpers import make_trainer, read_metrics


class Recorder(Callback):
    """Counts batches and records the loss each one returned."""

    def __init__(self) -> None:
        self.batches = 0
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.batches += 1
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.losses.append(float(loss))


# ------------------------------------------------------------------ BoringModel


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
    assert names_in(muon) == {"layer.0.weight", "layer.2.weight"}
    assert names_in(adamw) == {"layer.0.bias", "layer.2.bias", "layer.4.weight", "layer.4.bias"}
    assert adamw.defaults["fused"] is True
    for name, p in model.named_parameters():
        assert not torch.equal(p.detach(), before[name]), f"{name} did not move"
    # Each optimizer has state for exactly its own parameters.
    assert len(muon.state) == 2 and len(adamw.state) == 4
    assert fit.global_step == 5


# ---------------------------------------------------- Lightning's demo Transformer


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
    # Its configure_optimizers differs only in the optimizer choice: said at INFO, once, no warning.
    with warnings.catch_warnings(), caplog.at_level(logging.INFO):
        warnings.filterwarnings("error", module="lightning_muon")
        make_trainer(tmp_path, csv_dir=tmp_path, max_steps=16, callbacks=[recorder]).fit(model)
    replaced = [r.getMessage() for r in caplog.records if "configure_optimizers is replaced" in r.getMessage()]
    assert replaced == [
        "LightningTransformer.configure_optimizers is replaced by MuonMixin's: it would have built SGD(lr=0.1) on "
        "67 tensors; MuonMixin trains with Muon(lr=0.02) on 20 tensors and AdamW(lr=0.0003) on 47 tensors."
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


# --------------------------------------------------------------- update counting


class Regression(L.LightningModule):
    """A deterministic MLP regression: two hidden matrices on Muon, the head on AdamW."""

    def __init__(self, batch_size: int = 8, samples: int = 64) -> None:
        super().__init__()
        self.batch_size = batch_size
        self.samples = samples
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        x = torch.randn(self.samples, 8, generator=g)
        y = x.sum(dim=1, keepdim=True).sin()
        return DataLoader(TensorDataset(x, y), batch_size=self.batch_size)


class MuonRegression(MuonMixin, Regression):
    pass


def test_max_steps_counts_updates_not_optimizer_steps(tmp_path):
    model = MuonRegression()
    recorder = Recorder()
    fit = make_trainer(tmp_path, csv_dir=tmp_path, max_steps=10, callbacks=[recorder])
    fit.fit(model)
    assert fit.global_step == 10
    assert recorder.batches == 10
    _, adamw = (o.optimizer for o in model.optimizers())
    assert all(s["step"].item() == 10 for s in adamw.state.values())


def test_accumulation_takes_n_batches_per_update_and_names_checkpoints_by_updates(tmp_path):
    model = MuonRegression(batch_size=2, samples=64, accumulate_grad_batches=4)  # 32 batches an epoch
    recorder = Recorder()
    checkpoints = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=5, save_top_k=-1)
    fit = make_trainer(tmp_path, csv_dir=tmp_path, max_steps=10, callbacks=[recorder, checkpoints],
                       enable_checkpointing=True)
    fit.fit(model)
    assert fit.global_step == 10
    assert recorder.batches == 40
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["epoch=0-step=5.ckpt", "epoch=1-step=10.ckpt"]
    rows = read_metrics(tmp_path)
    steps = sorted({int(r["step"]) for r in rows if r.get("train_loss")})
    assert steps == list(range(10))  # logger steps are updates, one per 4 batches
    # The trainer is reusable afterwards: manual optimization's own check sees accumulate_grad_batches == 1 again.
    assert fit.accumulate_grad_batches == 1


def test_accumulating_four_micro_batches_of_two_equals_one_batch_of_eight(tmp_path):
    muon = functools.partial(Muon, lr=0.02, momentum=0.95, weight_decay=0.01, ns_dtype=torch.float32)
    torch.manual_seed(0)
    big = MuonRegression(batch_size=8, samples=64, muon=muon)
    torch.manual_seed(0)
    small = MuonRegression(batch_size=2, samples=64, muon=muon, accumulate_grad_batches=4)
    make_trainer(tmp_path / "big", max_steps=6).fit(big)
    make_trainer(tmp_path / "small", max_steps=6).fit(small)
    # Same gradients up to float32 summation order; fp32 Newton-Schulz keeps it that tight.
    for (name, a), b in zip(big.named_parameters(), small.parameters()):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=name)


def test_last_partial_group_of_an_epoch_still_steps(tmp_path):
    model = MuonRegression(batch_size=8, samples=40, accumulate_grad_batches=2)  # 5 batches: 2 + 1 updates
    fit = make_trainer(tmp_path, max_epochs=2)
    fit.fit(model)
    assert fit.global_step == 6


class GradientsAtStep(Callback):
    """Records the gradients each raw optimizer sees when it steps (after the mixin's clipping)."""

    def __init__(self) -> None:
        self.before_clip: list[dict[str, torch.Tensor]] = []
        self.at_step: list[dict[str, torch.Tensor]] = []

    def on_fit_start(self, trainer, pl_module):
        names = {id(p): n for n, p in pl_module.named_parameters()}
        for lightning_optimizer in pl_module.optimizers():
            optimizer = lightning_optimizer.optimizer
            original = optimizer.step

            def step(*args, _original=original, _optimizer=optimizer, **kwargs):
                grads = {names[id(p)]: p.grad.clone() for g in _optimizer.param_groups for p in g["params"]}
                self.at_step.append(grads)
                return _original(*args, **kwargs)

            optimizer.step = step

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        names = {id(p): n for n, p in pl_module.named_parameters()}
        self.before_clip.append({names[id(p)]: p.grad.clone() for g in optimizer.param_groups for p in g["params"]})


def test_clipping_clips_the_global_norm_over_both_optimizers_once(tmp_path):
    clip = 1e-3
    model = MuonRegression(gradient_clip_val=clip)
    spy = GradientsAtStep()
    make_trainer(tmp_path, max_steps=3, callbacks=[spy]).fit(model)
    assert len(spy.at_step) == 6  # two optimizers, three updates
    for update in range(3):
        before = {**spy.before_clip[2 * update], **spy.before_clip[2 * update + 1]}
        after = {**spy.at_step[2 * update], **spy.at_step[2 * update + 1]}
        assert set(before) == {n for n, _ in model.named_parameters()}
        norm_before = torch.linalg.vector_norm(torch.stack([g.norm() for g in before.values()]))
        norm_after = torch.linalg.vector_norm(torch.stack([g.norm() for g in after.values()]))
        assert norm_before > 10 * clip
        torch.testing.assert_close(norm_after, torch.tensor(clip), rtol=1e-4, atol=0)
        # One coefficient for every gradient of both optimizers: clipped globally, once.
        for name in before:
            torch.testing.assert_close(after[name], before[name] * (clip / norm_before), rtol=1e-4, atol=1e-12)


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


def test_the_mixin_adds_three_prefixed_attributes_to_the_module_and_no_more(tmp_path):
    """The user's module keeps its own namespace: the mixin's state is `_muon_config`, `_muon_loop` and the fit's
    `_muon_fit`, set only during a fit (besides what Lightning's own save_hyperparameters writes, which the mixin
    calls)."""
    plain, model = DeepBoring(), MuonBoring()
    plain.save_hyperparameters({"lr": 0.1})
    assert set(vars(model)) - set(vars(plain)) == {"_muon_config", "_muon_loop", "_muon_fit"}
    assert model._muon_fit is None

    class Spy(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            fits.append(pl_module._muon_fit)

    fits: list = []
    make_trainer(tmp_path, max_steps=3, callbacks=[Spy()]).fit(model)
    make_trainer(tmp_path / "plain", max_steps=3).fit(plain)
    assert set(vars(model)) - set(vars(plain)) == {"_muon_config", "_muon_loop", "_muon_fit"}
    assert len(fits) == 3 and fits[0] is not None and all(f is fits[0] for f in fits)  # one state for the fit
    assert model._muon_fit is None  # dropped at teardown


def test_hyperparameters_are_plain_data(tmp_path):
    model = MuonRegression()
    assert model.hparams["muon"] == {
        "class_path": "lightning_muon.Muon",
        "init_args": {"lr": 0.02, "momentum": 0.95, "weight_decay": 0.01},
    }
    json.dumps(dict(model.hparams))  # nothing but plain data


def test_routing_order_differences_are_refused():
    model = MuonRegression()
    names = _checkpoint.optimizer_names(model.muon_routing())
    checkpoint = {
        "lightning_muon": {
            "routing": {"Muon": names["Muon"][::-1], "AdamW": names["AdamW"]},
            "skipped_updates": 0,
            "consecutive_skips": 0,
            "micro_batches": 0,
        }
    }
    with pytest.raises(MisconfigurationException, match="Muon: the same parameters in a different order"):
        _checkpoint.check_routing(checkpoint["lightning_muon"], names)


def test_non_plain_constructor_arguments_are_left_out_of_hparams_with_a_warning():
    class WithBackbone(Regression):
        def __init__(self, backbone: nn.Module | None = None, **kwargs) -> None:
            super().__init__(**kwargs)
            self.backbone = backbone

    class MuonWithBackbone(MuonMixin, WithBackbone):
        pass

    with pytest.warns(UserWarning, match=r"left \['backbone'\] out of the saved hyperparameters"):
        model = MuonWithBackbone(backbone=nn.Linear(2, 2), batch_size=4)
    assert "backbone" not in model.hparams and model.hparams["batch_size"] == 4


def test_a_schedule_needing_the_fit_length_on_an_unbounded_fit_is_an_actionable_error(tmp_path):
    model = MuonRegression(lr_scheduler=functools.partial(WarmupCosine, warmup_steps=2))
    with pytest.raises(MisconfigurationException, match=r"set Trainer\(max_steps=...\) or max_epochs"):
        make_trainer(tmp_path, max_epochs=-1).fit(model)


def test_a_factory_that_cannot_be_saved_as_a_spec_is_warned_about():
    with pytest.warns(UserWarning, match=r"`muon` \(.*<lambda>\) cannot be saved as a loadable spec"):
        MuonRegression(muon=lambda params: Muon(params, lr=0.02))
