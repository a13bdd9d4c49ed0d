"""The optimizer pair owns its param groups (`lightning_muon.lightning._pair`): a checkpoint restored inside a fit
after the first batch moved a parameter (Lightning's batch-size finder) gets optimizers that hold its groups; the
users' finetuning callbacks are left as they built them (no method in their instance dictionary during the fit);
a plain ``BackboneFinetuning``, whose one backbone lr cannot hold for two optimizers, is refused before training
with the fix; a group's origin is recorded, not read from its name."""

from __future__ import annotations

import warnings

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import BackboneFinetuning, BatchSizeFinder

from lightning_muon import MuonBackboneFinetuning

from helpers import (
    ADAMW_NAMES,
    MUON_NAMES,
    MuonRegression,
    finetuning_classes,
    make_trainer,
    raw_optimizers,
    same,
    snapshot,
)


def held(model: L.LightningModule) -> list[list[tuple[str, list[str]]]]:
    return [[(g["name"], list(g["param_names"])) for g in o.param_groups] for o in raw_optimizers(model)]


def test_the_batch_size_finder_restores_into_the_pair_and_the_fit_equals_one_without_it(tmp_path):
    """The finder saves before the first batch, runs trial steps (the first batch moves net.0.weight, the input
    layer, from Muon to AdamW, and the optimizers step), then restores its checkpoint: the pair takes the
    checkpoint's groups before torch loads its (empty) states, and the fit then follows its first batch again. It
    ended in a ValueError inside torch's load_state_dict before."""
    found = MuonRegression(samples=256)
    trainer = make_trainer(tmp_path / "found", max_steps=6,
                           callbacks=[BatchSizeFinder(max_trials=2, steps_per_trial=2)])
    trainer.fit(found)
    assert found.batch_size == 4 and trainer.global_step == 6
    plain = MuonRegression(samples=256, batch_size=found.batch_size)
    make_trainer(tmp_path / "plain", max_steps=6).fit(plain)
    assert held(found) == held(plain) == [[("hidden", MUON_NAMES)], [
        ("input", ["net.0.weight"]), ("head", ["net.4.weight", "net.4.bias"]),
        ("norms_and_biases", ["net.0.bias", "net.2.bias"])]]
    assert sorted(n for o in held(found) for _, names in o for n in names) == sorted(MUON_NAMES + ADAMW_NAMES)
    assert same(snapshot(found), snapshot(plain))


def test_a_checkpoint_whose_groups_the_fit_cannot_hold_is_refused_by_the_pair_before_torch_sees_it(tmp_path):
    """A checkpoint restored inside a fit whose model routes differently (a user pattern added): one refusal naming
    both layouts, from the mixin, not torch's "doesn't match the size of optimizer's group"."""
    path = tmp_path / "saved.ckpt"
    saver = MuonRegression()
    trainer = make_trainer(tmp_path, max_steps=2)
    trainer.fit(saver)
    trainer.save_checkpoint(path)
    record = torch.load(path, weights_only=True)["lightning_muon"]
    assert record["groups"] == [[[n, list(p)] for n, p in o] for o in held(saver)] and record["added_groups"] == []
    other = MuonRegression(muon_params=["net.0.weight"])
    with pytest.raises(Exception, match=r"(?s)different routing.*net.0.weight"):
        make_trainer(tmp_path / "other", max_steps=4).fit(other, ckpt_path=path)


def backbone_module():
    return finetuning_classes(L.pytorch)[0]()


Unfreeze = finetuning_classes(L.pytorch)[1]


#: What Lightning's own Trainer attaches to every callback instance (``callback_connector``): the module's logging.
LIGHTNING_ATTACHES = {"log", "log_dict"}


class InstanceWatch(L.Callback):
    """Records, at every batch start, the callables in ``watched``'s instance dictionary."""

    def __init__(self, watched):
        self.watched, self.seen = watched, set()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.seen |= {name for name, value in vars(self.watched).items() if callable(value)}


@pytest.mark.parametrize("make", [pytest.param(lambda: MuonBackboneFinetuning(unfreeze_backbone_at_epoch=1),
                                               id="MuonBackboneFinetuning"),
                                  pytest.param(Unfreeze, id="own-BaseFinetuning")])
def test_finetuning_callbacks_are_left_as_built_and_lightning_warns_nothing(tmp_path, make):
    callback = make()
    before = dict(vars(callback))
    own = {name for name, value in before.items() if callable(value)} | LIGHTNING_ATTACHES  # lambda_func
    watch = InstanceWatch(callback)
    model = backbone_module()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        make_trainer(tmp_path, max_epochs=2, callbacks=[callback, watch]).fit(model)
    assert watch.seen <= own and {n for n, v in vars(callback).items() if callable(v)} <= own
    assert not {"on_train_epoch_start", "state_dict", "finetune_function"} & set(vars(callback))
    assert set(vars(callback)) <= set(before) | LIGHTNING_ATTACHES
    assert not [w for w in caught if "already exist" in str(w.message)]  # each optimizer was offered its own part
    muon, adamw = held(model)
    assert muon[-1] == ("unfrozen_1", ["backbone.3.weight"])
    assert adamw[-1] == ("unfrozen_1", ["backbone.0.weight", "backbone.0.bias", "backbone.1.weight",
                                        "backbone.1.bias", "backbone.3.bias"])
    # Lightning's own record of the groups (what its on_fit_start gives back on resume) is right for both
    recorded = callback.state_dict()["internal_optimizer_metadata"]
    assert [[(g["name"], g["param_names"]) for g in recorded[i]] for i in (0, 1)] == [muon, adamw]


def test_a_plain_backbone_finetuning_is_refused_before_training_naming_the_subclass(tmp_path):
    model = backbone_module()
    before = snapshot(model)
    with pytest.raises(Exception, match=r"BackboneFinetuning keeps one backbone learning rate(.|\n)*"
                                        r"lightning_muon.MuonBackboneFinetuning with the same arguments"):
        make_trainer(tmp_path, max_epochs=2, callbacks=[BackboneFinetuning(unfreeze_backbone_at_epoch=1)]).fit(model)
    assert same(snapshot(model), before)
