"""`lightning_muon.examples.torch_layers` through a real Trainer: the depthwise-separable CNN's depthwise kernels and
the char-LSTM's gates reach Muon as their blocks (a group, a gate each), the table says so, and the routing survives
a checkpoint."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_muon import Muon
from lightning_muon.examples.text_data import StdlibTextDataModule
from lightning_muon.examples.torch_layers import MuonCharLSTM, MuonSeparableCNN
from lightning_muon.routing import ADAMW

from helpers import make_trainer

UNCALLED = r"configure_optimizers will never be called"


def muon_blocks(model) -> dict[str, list[int] | None]:
    """What the fit's Muon holds: each parameter's row blocks."""
    muon = model.optimizers()[0].optimizer
    assert isinstance(muon, Muon)
    return {n: b for g in muon.param_groups
            for n, b in zip(g["param_names"], g.get("matrix_blocks") or [None] * len(g["params"]), strict=True)}


@pytest.mark.filterwarnings(f"ignore:SeparableCNN.{UNCALLED}")
def test_the_separable_cnn_steps_its_depthwise_kernels_per_channel(tmp_path):
    from lightning_muon.examples.digits_cnn import DigitsDataModule

    torch.manual_seed(0)
    model = MuonSeparableCNN(channels=8, blocks_per_stage=1)
    trainer = make_trainer(tmp_path, max_steps=3, limit_val_batches=1, enable_checkpointing=True)
    trainer.fit(model, datamodule=DigitsDataModule())
    assert trainer.global_step == 3
    assert muon_blocks(model) == {"blocks.0.0.weight": [1] * 8, "blocks.0.3.weight": None,
                                  "blocks.1.0.weight": [1] * 8, "blocks.1.3.weight": None}
    reasons = {r.name: r.reason for r in model.muon_routing().routes}
    assert reasons["blocks.1.0.weight"] == "4D depthwise kernel of 8 groups; each group orthogonalised alone as 1x9"
    assert reasons["stem.weight"].startswith("input layer")
    path = tmp_path / "separable.ckpt"
    trainer.save_checkpoint(path)
    loaded = MuonSeparableCNN.load_from_checkpoint(path, weights_only=True)
    assert loaded.muon_routing().routes == model.muon_routing().routes


@pytest.mark.filterwarnings(f"ignore:CharLSTM.{UNCALLED}")
def test_the_char_lstm_steps_each_gate_alone(tmp_path):
    torch.manual_seed(0)
    model = MuonCharLSTM(n_embd=8, hidden_size=16, n_layer=2)
    data = StdlibTextDataModule(max_bytes=120_000, block_size=16, batch_size=4, train_batches_per_epoch=3,
                                val_batches=1, cache_dir=str(tmp_path / "cache"))
    trainer = make_trainer(tmp_path, max_steps=3)
    trainer.fit(model, datamodule=data)
    assert trainer.global_step == 3
    gates = [f"lstm.weight_{kind}_l{layer}" for layer in (0, 1) for kind in ("ih", "hh")]
    assert muon_blocks(model) == dict.fromkeys(gates, [16] * 4)
    routes = {r.name: r for r in model.muon_routing().routes}
    assert {n for n, r in routes.items() if r.optimizer == ADAMW} == {
        "embedding.weight", "head.weight", "head.bias", *(f"lstm.bias_{k}_l{i}" for k in ("ih", "hh") for i in (0, 1))}
    assert routes["lstm.weight_hh_l1"].reason.endswith("fused LSTM gates i, f, g, o 16+16+16+16: each gate "
                                                       "orthogonalised alone (measured, benchmarks/torch_layers.py)")
    assert math.isfinite(trainer.callback_metrics["val_loss"])
