"""`MuonWithAdamW` from a plain ``configure_optimizers``: Lightning's automatic optimization, no mixin. A real
Trainer with ``accumulate_grad_batches``, ``gradient_clip_val`` and a per-step scheduler lands on the weights of
the same maths written by hand, bit for bit; ``LearningRateMonitor`` names every group; a checkpoint resumes
exactly; the ``[Muon, AdamW]`` states a `MuonMixin` fit saves load into it."""

from __future__ import annotations

import copy

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import LearningRateMonitor
from lightning.pytorch.cli import OptimizerCallable
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from lightning_muon import MuonMixin, MuonWithAdamW

from helpers import make_trainer, read_metrics

KWARGS = {"lr": 0.02, "adamw_lr": 3e-3, "weight_decay": 0.05, "adamw_weight_decay": 0.01}
BATCH, SAMPLES, ACCUMULATE, CLIP = 16, 128, 2, 0.5


def decay(step: int) -> float:
    return 0.9**step


def data() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randint(16, (SAMPLES, 8), generator=g)
    return TensorDataset(x, (x[:, 0] + x[:, 1]) % 16)


class Classifier(L.LightningModule):
    """An embedding, two hidden matrices, a norm and a head; ``optimizer`` builds the optimizer from the module
    (LightningCLI fills it from a ``class_path`` config), else `MuonWithAdamW.from_model` with `KWARGS`."""

    def __init__(self, optimizer: OptimizerCallable | None = None) -> None:
        super().__init__()
        self.optimizer = optimizer
        torch.manual_seed(0)
        self.embed = nn.Embedding(16, 8)
        self.hidden = nn.Linear(64, 32)
        self.hidden2 = nn.Linear(32, 32)
        self.norm = nn.LayerNorm(32)
        self.head = nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(F.gelu(self.hidden(self.embed(x).flatten(1))))
        return self.head(h + F.gelu(self.hidden2(h)))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss)
        return loss

    def train_dataloader(self):
        return DataLoader(data(), batch_size=BATCH)

    def configure_optimizers(self):
        optimizer = self.optimizer(self) if self.optimizer else MuonWithAdamW.from_model(self, **KWARGS)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, decay)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def by_hand(model: Classifier, updates: int) -> list[float]:
    """What the Trainer should do: mean of ``ACCUMULATE`` micro-batch losses, one global norm clip over the
    optimizer's parameters (in its order), one step of both algorithms, the scheduler per update."""
    optimizer = MuonWithAdamW.from_model(model, **KWARGS)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, decay)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    batches = iter(DataLoader(data(), batch_size=BATCH))
    losses = []
    for _ in range(updates):
        for _ in range(ACCUMULATE):
            x, y = next(batches)
            loss = F.cross_entropy(model(x), y)
            (loss / ACCUMULATE).backward()
            losses.append(float(loss.detach()))
        torch.nn.utils.clip_grad_norm_(params, CLIP)
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
    return losses


def test_automatic_optimization_with_accumulation_clipping_and_a_scheduler_is_the_maths_by_hand(tmp_path):
    updates = SAMPLES // BATCH // ACCUMULATE  # one epoch
    model = Classifier()
    trainer = make_trainer(
        tmp_path, csv_dir=tmp_path / "csv", max_epochs=1, accumulate_grad_batches=ACCUMULATE,
        gradient_clip_val=CLIP, callbacks=[LearningRateMonitor()],
    )
    trainer.fit(model)
    assert model.automatic_optimization and trainer.global_step == updates
    reference = Classifier()
    expected_losses = by_hand(reference, updates)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(p, q), f"{name}: max abs diff {(p - q).abs().max().item()}"
    rows = read_metrics(tmp_path / "csv")
    logged = [float(r["train_loss"]) for r in rows if r.get("train_loss")]
    assert logged == pytest.approx(expected_losses[ACCUMULATE - 1 :: ACCUMULATE], rel=1e-6)  # at each update
    assert expected_losses[-1] < expected_losses[0]
    keys = {k for r in rows for k, v in r.items() if v and k.startswith("lr-")}
    assert keys == {"lr-MuonWithAdamW/hidden", "lr-MuonWithAdamW/embeddings", "lr-MuonWithAdamW/head",
                    "lr-MuonWithAdamW/norms_and_biases"}
    last = rows[-1] if rows[-1].get("lr-MuonWithAdamW/hidden") else next(r for r in reversed(rows) if r.get(
        "lr-MuonWithAdamW/hidden"))
    assert float(last["lr-MuonWithAdamW/hidden"]) == pytest.approx(0.02 * 0.9 ** (updates - 1))
    assert float(last["lr-MuonWithAdamW/head"]) == pytest.approx(3e-3 * 0.9 ** (updates - 1))


def test_a_checkpoint_resumes_exactly(tmp_path):
    through = Classifier()
    make_trainer(tmp_path / "a", max_epochs=2, accumulate_grad_batches=ACCUMULATE).fit(through)
    first = Classifier()  # stopped at an epoch's end: a mid-epoch resume would start the epoch's data again
    trainer = make_trainer(tmp_path / "b", max_epochs=1, accumulate_grad_batches=ACCUMULATE)
    trainer.fit(first)
    trainer.save_checkpoint(tmp_path / "half.ckpt")
    assert len(torch.load(tmp_path / "half.ckpt", weights_only=True)["optimizer_states"]) == 1
    resumed = Classifier()
    resuming = make_trainer(tmp_path / "c", max_epochs=2, accumulate_grad_batches=ACCUMULATE)
    resuming.fit(resumed, ckpt_path=tmp_path / "half.ckpt")
    assert resuming.global_step == 2 * SAMPLES // BATCH // ACCUMULATE
    for (name, p), q in zip(through.named_parameters(), resumed.parameters()):
        assert torch.equal(p, q), name


class MixinClassifier(MuonMixin, Classifier):
    pass


def test_the_mixins_saved_pair_loads_into_the_single_optimizer(tmp_path):
    mixed = MixinClassifier(muon={"class_path": "lightning_muon.Muon", "init_args": {"lr": 0.02, "weight_decay": 0.05}},
                            adamw={"class_path": "torch.optim.AdamW", "init_args": {"lr": 3e-3, "weight_decay": 0.01}})
    trainer = make_trainer(tmp_path, max_steps=2)
    trainer.fit(mixed)
    trainer.save_checkpoint(tmp_path / "mixin.ckpt")
    checkpoint = torch.load(tmp_path / "mixin.ckpt", weights_only=True)
    muon_state, adamw_state = checkpoint["optimizer_states"]
    plain = Classifier()
    plain.load_state_dict(checkpoint["state_dict"])
    single = MuonWithAdamW.from_model(plain, **KWARGS)
    single.load_pair_state_dicts(copy.deepcopy(muon_state), copy.deepcopy(adamw_state))
    muon_back, adamw_back = single.pair_state_dicts()
    assert muon_back["param_groups"] == muon_state["param_groups"]
    assert adamw_back["param_groups"] == adamw_state["param_groups"]
    for back, saved in ((muon_back, muon_state), (adamw_back, adamw_state)):
        assert back["state"].keys() == saved["state"].keys() and back["state"]
        for i, entry in saved["state"].items():
            assert all(torch.equal(back["state"][i][k], v) for k, v in entry.items())
    assert single.param_groups[0]["param_names"] == mixed.muon_routing().names("Muon")


def test_muon_monitor_diagnoses_the_muon_inside(tmp_path):
    from lightning_muon import MuonMonitor

    model = Classifier()
    trainer = make_trainer(tmp_path, csv_dir=tmp_path / "csv", max_steps=4, accumulate_grad_batches=ACCUMULATE,
                           callbacks=[MuonMonitor(log_every_n_steps=2, per_parameter=True)])
    trainer.fit(model)
    rows = [r for r in read_metrics(tmp_path / "csv") if r.get("muon/orthogonality_error")]
    assert [int(r["step"]) for r in rows] == [1, 3]  # every 2nd update
    for row in rows:
        assert 0.0 < float(row["muon/orthogonality_error"]) <= float(row["muon/orthogonality_error_max"]) < 1.0
        assert float(row["muon/orthogonality_error/hidden.weight"]) > 0.0
        assert float(row["muon/effective_lr_max"]) == pytest.approx(0.02 * 0.9 ** int(row["step"]))
        assert {"lr-MuonWithAdamW/hidden", "lr-MuonWithAdamW/head"} <= {k for k, v in row.items() if v}
    assert not [k for k in rows[0] if k.startswith("muon/orthogonality_error/") and "head" in k]  # AdamW's
