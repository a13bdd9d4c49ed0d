"""Checkpoints of a MuonMixin fit, through a real Trainer.

A resume equals the uninterrupted run bit for bit (both optimizers' and schedulers' states, the routing record,
plain-data hyperparameters); ``load_from_checkpoint`` rebuilds the same configuration; refused, saying why: a
different routing (or the same parameters in another order), the AdamW baseline from a Muon checkpoint, a
checkpoint without the routing record (a plain module's; with the way to start fresh from its weights), and an
unreadable (empty or truncated) file.
"""

from __future__ import annotations

import functools
import re

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from lightning_muon import Muon, WarmupCosine
from lightning_muon.lightning import _checkpoint
from lightning_muon.optim import AdamW

from helpers import (
    ADAMW_NAMES,
    MUON_NAMES,
    MuonRegression,
    PlainRegression,
    make_trainer,
    raw_optimizers,
    snapshot,
)

SCHEDULE = functools.partial(WarmupCosine, warmup_steps=2)


@pytest.fixture(scope="module")
def two_epoch_run(tmp_path_factory):
    """Two epochs straight (4 updates each), saving a checkpoint at the end of each (both with total_steps 8)."""
    root = tmp_path_factory.mktemp("resume")
    model = MuonRegression(lr_scheduler=SCHEDULE)
    checkpoints = ModelCheckpoint(dirpath=root, filename="{epoch}", save_top_k=-1, every_n_epochs=1)
    trainer = make_trainer(root, max_epochs=2, enable_checkpointing=True, callbacks=[checkpoints])
    trainer.fit(model)
    assert trainer.global_step == 8
    lrs = [g["lr"] for o in raw_optimizers(model) for g in o.param_groups]
    return {"params": snapshot(model), "lrs": lrs, "ckpt": root / "epoch=0.ckpt", "model": model}


def test_resume_reproduces_the_uninterrupted_run_exactly(tmp_path, two_epoch_run):
    path = two_epoch_run["ckpt"]
    checkpoint = torch.load(path, weights_only=True)  # hyperparameters and states are plain data
    assert checkpoint["global_step"] == 4 and checkpoint["epoch"] == 0
    assert len(checkpoint["optimizer_states"]) == 2
    assert len(checkpoint["lr_schedulers"]) == 2
    assert all(s["total_steps"] == 8 and s["last_epoch"] == 4 for s in checkpoint["lr_schedulers"])
    assert checkpoint["lightning_muon"]["routing"] == {"Muon": MUON_NAMES, "AdamW": ADAMW_NAMES}
    assert checkpoint["lightning_muon"]["skipped_updates"] == 0
    muon_state, adamw_state = checkpoint["optimizer_states"]
    assert [g["name"] for g in muon_state["param_groups"]] == ["hidden"]
    assert [n for g in muon_state["param_groups"] for n in g["param_names"]] == MUON_NAMES
    assert [n for g in adamw_state["param_groups"] for n in g["param_names"]] == ADAMW_NAMES
    hparams = checkpoint["hyper_parameters"]
    assert hparams["lr_scheduler"] == {
        "class_path": "lightning_muon.WarmupCosine",
        "init_args": {"warmup_steps": 2},
    }
    assert hparams["muon"]["class_path"] == "lightning_muon.Muon"
    assert hparams["adamw"]["class_path"] == "torch.optim.AdamW"

    resumed = MuonRegression(lr_scheduler=SCHEDULE)
    trainer = make_trainer(tmp_path, max_epochs=2)
    trainer.fit(resumed, ckpt_path=path)
    assert trainer.global_step == 8
    final = snapshot(resumed)
    expected = two_epoch_run["params"]
    assert final.keys() == expected.keys()
    for name in expected:
        assert torch.equal(final[name], expected[name]), name
    assert [g["lr"] for o in raw_optimizers(resumed) for g in o.param_groups] == two_epoch_run["lrs"]

    # Control: the same weights without the optimizer and scheduler states end elsewhere, so the
    # equality above really depends on both states being restored.
    fresh = MuonRegression(lr_scheduler=SCHEDULE)
    fresh.load_state_dict(checkpoint["state_dict"])
    make_trainer(tmp_path / "fresh", max_epochs=1).fit(fresh)
    assert not torch.equal(snapshot(fresh)["net.2.weight"], expected["net.2.weight"])


def test_load_from_checkpoint_rebuilds_the_same_configuration(tmp_path, two_epoch_run):
    loaded = MuonRegression.load_from_checkpoint(two_epoch_run["ckpt"], weights_only=True)
    assert loaded.hparams == two_epoch_run["model"].hparams  # the whole configuration, as plain data
    trainer = make_trainer(tmp_path, max_steps=1)
    trainer.fit(loaded)  # what it builds from them
    muon, adamw = raw_optimizers(loaded)
    assert type(muon) is Muon and type(adamw) is torch.optim.AdamW
    assert {k: muon.defaults[k] for k in ("lr", "momentum", "weight_decay")} == {
        "lr": 0.02, "momentum": 0.95, "weight_decay": 0.01
    }
    schedulers = [config.scheduler for config in trainer.lr_scheduler_configs]
    assert [type(s) for s in schedulers] == [WarmupCosine] * 2 and all(s.warmup_steps == 2 for s in schedulers)


#: Every update-rule option of issue 41 at once: NorMuon and cautious weight decay on the Muon factory, cautious
#: weight decay on the AdamW half, and the hidden 24x16 matrix split into row blocks of 16 and 8 (as a fused
#: projection's).
OPTIONS = {"muon": functools.partial(Muon, lr=0.02, weight_decay=0.01, normuon_beta2=0.95, cautious_weight_decay=True),
           "adamw": functools.partial(AdamW, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, cautious_weight_decay=True),
           "matrix_blocks": {"net.2.weight": [16, 8]}}


def test_resume_with_normuon_cautious_decay_and_blocks_reproduces_the_uninterrupted_run(tmp_path):
    """The second moments (one per row of each block) travel in the checkpoint, the settings in its
    hyperparameters, and the resumed fit ends bit for bit where the straight one did."""
    checkpoints = ModelCheckpoint(dirpath=tmp_path, filename="{epoch}", save_top_k=-1, every_n_epochs=1)
    straight = MuonRegression(lr_scheduler=SCHEDULE, **OPTIONS)
    make_trainer(tmp_path / "straight", max_epochs=2, enable_checkpointing=True, callbacks=[checkpoints]).fit(straight)
    checkpoint = torch.load(tmp_path / "epoch=0.ckpt", weights_only=True)
    (moment,) = [state["normuon_second_moment"] for state in checkpoint["optimizer_states"][0]["state"].values()]
    assert moment.shape == (24, 1) and moment.dtype == torch.float32 and bool((moment > 0).all())
    (group,) = checkpoint["optimizer_states"][0]["param_groups"]
    assert (group["normuon_beta2"], group["cautious_weight_decay"], group["matrix_blocks"]) == (0.95, True, [[16, 8]])
    assert checkpoint["hyper_parameters"]["matrix_blocks"] == {"net.2.weight": [16, 8]}
    assert checkpoint["hyper_parameters"]["adamw"]["class_path"] == "lightning_muon.optim.adamw.AdamW"
    assert all(g["cautious_weight_decay"] for g in checkpoint["optimizer_states"][1]["param_groups"])

    resumed = MuonRegression(lr_scheduler=SCHEDULE, **OPTIONS)
    make_trainer(tmp_path / "resumed", max_epochs=2).fit(resumed, ckpt_path=tmp_path / "epoch=0.ckpt")
    expected, final = snapshot(straight), snapshot(resumed)
    for name in expected:
        assert torch.equal(final[name], expected[name]), name
    # Control: the moments matter (zeroed, the resume ends elsewhere).
    for state in checkpoint["optimizer_states"][0]["state"].values():
        state["normuon_second_moment"].zero_()
    torch.save(checkpoint, tmp_path / "zeroed.ckpt")
    zeroed = MuonRegression(lr_scheduler=SCHEDULE, **OPTIONS)
    make_trainer(tmp_path / "zeroed", max_epochs=2).fit(zeroed, ckpt_path=tmp_path / "zeroed.ckpt")
    assert not torch.equal(snapshot(zeroed)["net.2.weight"], expected["net.2.weight"])


def test_resume_with_different_routing_is_refused(tmp_path, two_epoch_run):
    model = MuonRegression(lr_scheduler=SCHEDULE, adamw_params=["net.2.weight"])
    assert model.muon_routing().names("AdamW").count("net.2.weight") == 1
    trainer = make_trainer(tmp_path, max_epochs=2)
    with pytest.raises(MisconfigurationException, match="different routing") as error:
        trainer.fit(model, ckpt_path=two_epoch_run["ckpt"])
    message = str(error.value)
    assert "net.2.weight: was on Muon, not now" in message
    assert "net.2.weight: now on AdamW, was not" in message
    assert "net.0.weight" not in message  # only the differences are listed


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


def test_resuming_a_muon_checkpoint_into_the_adamw_baseline_is_refused_clearly(tmp_path, two_epoch_run):
    model = MuonRegression(muon=None, lr_scheduler=SCHEDULE)
    with pytest.raises(MisconfigurationException, match=r"different routing(.|\n)*net\.2\.weight: was on Muon"):
        make_trainer(tmp_path, max_epochs=2).fit(model, ckpt_path=two_epoch_run["ckpt"])


def test_a_checkpoint_without_the_routing_record_is_refused_with_the_way_to_start_fresh(tmp_path):
    plain = make_trainer(tmp_path, max_steps=2)
    plain.fit(PlainRegression())
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


def test_a_resume_into_a_model_built_differently_names_every_added_removed_and_reshaped_parameter(
        tmp_path, two_epoch_run):
    class Grown(MuonRegression):
        """The head ``net.4`` became 24 -> 24 and a new head follows; the first layer lost its bias."""

        def __init__(self) -> None:
            super().__init__(lr_scheduler=SCHEDULE)
            with torch.random.fork_rng():
                torch.manual_seed(0)
                self.net[0] = torch.nn.Linear(8, 16, bias=False)
                self.net[4] = torch.nn.Linear(24, 24)
                self.net.append(torch.nn.Linear(24, 1))

    with pytest.raises(MisconfigurationException, match="other trainable parameters") as error:
        make_trainer(tmp_path, max_epochs=2).fit(Grown(), ckpt_path=two_epoch_run["ckpt"])
    lines = str(error.value).splitlines()
    assert "  net.0.bias: in the checkpoint, not in this model" in lines
    assert "  net.5.weight: in this model, not in the checkpoint" in lines
    assert "  net.5.bias: in this model, not in the checkpoint" in lines
    assert "  net.4.weight: 1x24 in the checkpoint, 24x24 in this model" in lines
    assert "  net.4.bias: 1 in the checkpoint, 24 in this model" in lines
    assert not [line for line in lines if line.startswith("  net.2")]  # only the differences


def test_a_checkpoint_saved_with_another_matrix_structure_resumes_with_the_routing_s(tmp_path):
    """torch's load_state_dict takes a saved param group's keys: a checkpoint saved before the routing split a matrix
    into blocks (an LSTM's gates, a grouped kernel: this release's defaults) would step it whole again while the
    table says per block. The resume gives the groups the routing's structure, says so, and ends where the fit
    saved with the blocks does (bit for bit); the momentum buffers carry over."""
    blocks = {"matrix_blocks": {"net.2.weight": [16, 8]}}
    checkpoints = ModelCheckpoint(dirpath=tmp_path, filename="{epoch}", save_top_k=-1, every_n_epochs=1)
    straight = MuonRegression(**blocks)
    make_trainer(tmp_path / "straight", max_epochs=2, enable_checkpointing=True, callbacks=[checkpoints]).fit(straight)
    checkpoint = torch.load(tmp_path / "epoch=0.ckpt", weights_only=True)
    (group,) = checkpoint["optimizer_states"][0]["param_groups"]
    del group["matrix_blocks"]  # as saved before the routing split it
    torch.save(checkpoint, tmp_path / "older.ckpt")

    resumed = MuonRegression(**blocks)
    with pytest.warns(UserWarning, match=r"resuming with the routing's .*net\.2\.weight \(blocks None -> \[16, 8\]\)"):
        make_trainer(tmp_path / "resumed", max_epochs=2).fit(resumed, ckpt_path=tmp_path / "older.ckpt")
    (muon, _) = raw_optimizers(resumed)
    assert muon.param_groups[0]["matrix_blocks"] == [[16, 8]]
    expected, final = snapshot(straight), snapshot(resumed)
    for name in expected:
        assert torch.equal(final[name], expected[name]), name
