"""Fine-tuning under MuonMixin, through a real Trainer: PEFT LoRA on a transformers Llama with the mixin's
defaults (lora_A on Muon, lora_B on AdamW, as measured) and all on Muon (Muon alone trains it), the frozen base
left bit-identical,
checkpoints that round-trip and resume exactly; a routing that leaves Muon empty trains and resumes too; and
Lightning's finetuning callbacks (BaseFinetuning, BackboneFinetuning) under both Lightning packages: what they
unfreeze routed, each optimizer's backbone lr by its own lr, resumes before and after the unfreeze bit-identical
to the uninterrupted run."""

from __future__ import annotations

import functools

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import BaseFinetuning, ModelCheckpoint

from lightning_muon import MuonBackboneFinetuning, MuonMixin, MuonMonitor, WarmupCosine

from helpers import (
    MuonRegression,
    finetuning_classes,
    make_trainer,
    raw_optimizers,
    read_metrics,
    same,
    snapshot,
    tiny_llama,
)

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")


class LoraLM(L.LightningModule):
    """A tiny random-init Llama wrapped by ``peft.get_peft_model`` (LoRA r=4 on q_proj and v_proj), on fixed
    random tokens: 4 batches an epoch."""

    def __init__(self) -> None:
        super().__init__()
        with torch.random.fork_rng():
            torch.manual_seed(0)
            self.model = peft.get_peft_model(tiny_llama(), peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))

    def training_step(self, batch, batch_idx):
        (tokens,) = batch
        loss = self.model(input_ids=tokens, labels=tokens).loss
        self.log("train_loss", loss)
        return loss

    def train_dataloader(self):
        tokens = torch.randint(0, 64, (16, 16), generator=torch.Generator().manual_seed(0))
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(tokens), batch_size=4)


class MuonLoraLM(MuonMixin, LoraLM):
    pass


def two_epochs(root, model, ckpt_path=None, **kwargs):
    checkpoints = ModelCheckpoint(dirpath=root, filename="{epoch}", save_top_k=-1, every_n_epochs=1)
    make_trainer(root, max_epochs=2, enable_checkpointing=True, callbacks=[checkpoints], **kwargs).fit(
        model, ckpt_path=ckpt_path)
    return snapshot(model)


#: Every adapter on Muon: the routing leaves AdamW nothing, so Muon alone trains the model.
ALL_ON_MUON = {"muon_params": ["*lora_*"]}


def test_lora_with_the_defaults_trains_only_the_adapters_a_on_muon_and_b_on_adamw(tmp_path):
    """The default follows benchmarks/finetune.py's measurement: ``lora_A`` on Muon, ``lora_B`` on AdamW."""
    model = MuonLoraLM()
    frozen_before = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    lora_before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    make_trainer(tmp_path, max_steps=4, csv_dir=tmp_path, callbacks=[MuonMonitor()]).fit(model)
    muon, adamw = raw_optimizers(model)
    on = {opt: sorted(n for g in opt.param_groups for n in g["param_names"]) for opt in (muon, adamw)}
    assert on[muon] == sorted(n for n in lora_before if ".lora_A." in n) and len(on[muon]) == 4
    assert on[adamw] == sorted(n for n in lora_before if ".lora_B." in n) and len(on[adamw]) == 4
    assert [g["name"] for g in adamw.param_groups] == ["adapters"]
    after = dict(model.named_parameters())
    assert all(torch.equal(after[n], p) for n, p in frozen_before.items())  # the base, bit for bit
    assert all(not torch.equal(after[n], p) for n, p in lora_before.items())  # every adapter trained
    logged = read_metrics(tmp_path)
    assert sum(1 for row in logged if row.get("lr-Muon/hidden")) == sum(
        1 for row in logged if row.get("lr-AdamW/adapters")) == 4


def test_lora_all_on_muon_trains_with_muon_alone(tmp_path, caplog):
    """Either side may be empty: every adapter on Muon leaves AdamW nothing, and Muon alone trains the model."""
    model = MuonLoraLM(**ALL_ON_MUON)
    lora_before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    with caplog.at_level("INFO", logger="lightning.pytorch.utilities.rank_zero"):
        make_trainer(tmp_path, max_steps=4, csv_dir=tmp_path, callbacks=[MuonMonitor()]).fit(model)
    assert [r.message for r in caplog.records if "no parameter was routed to AdamW" in r.message]
    (muon,) = raw_optimizers(model)
    names = [n for g in muon.param_groups for n in g["param_names"]]
    assert len(names) == 8 and sorted(names) == sorted(lora_before)
    logged = read_metrics(tmp_path)
    assert sum(1 for row in logged if row.get("lr-Muon/hidden")) == 4
    assert not [k for k in logged[0] if k.startswith("lr-AdamW")]


@pytest.mark.parametrize("arguments", [{}, ALL_ON_MUON], ids=["default", "muon-alone"])
def test_a_lora_checkpoint_loads_back_and_resumes_exactly(tmp_path, arguments):
    straight = two_epochs(tmp_path / "straight", MuonLoraLM(**arguments))
    path = tmp_path / "straight" / "epoch=1.ckpt"
    loaded = MuonLoraLM.load_from_checkpoint(path, weights_only=True)
    assert same(snapshot(loaded), straight)
    assert LoraLM.load_from_checkpoint(path, weights_only=True).state_dict().keys() == loaded.state_dict().keys()
    resumed = MuonLoraLM(**arguments)
    final = two_epochs(tmp_path / "resumed", resumed, ckpt_path=tmp_path / "straight" / "epoch=0.ckpt")
    assert same(final, straight)
    assert len(raw_optimizers(resumed)) == (1 if arguments else 2)


def test_a_routing_with_nothing_on_muon_trains_and_resumes_on_adamw_alone(tmp_path):
    arguments = {"adamw_params": ["net.*"]}
    with pytest.warns(UserWarning, match="no parameter was routed to Muon"):
        straight = two_epochs(tmp_path / "straight", MuonRegression(**arguments))
    resumed = MuonRegression(**arguments)
    final = two_epochs(tmp_path / "resumed", resumed, ckpt_path=tmp_path / "straight" / "epoch=0.ckpt")
    assert same(final, straight)
    (adamw,) = raw_optimizers(resumed)
    assert isinstance(adamw, torch.optim.AdamW)


# ------------------------------------------------------------------ parameters unfrozen during a fit


PACKAGES = [pytest.param("lightning.pytorch", id="lightning.pytorch"),
            pytest.param("pytorch_lightning", id="pytorch_lightning")]


@pytest.mark.parametrize("package", PACKAGES)
def test_what_basefinetuning_unfreezes_is_routed_matrices_to_muon_the_rest_to_adamw(tmp_path, package):
    import importlib

    pl = importlib.import_module(package)
    module_class, unfreeze = finetuning_classes(pl)
    model = module_class()
    frozen = {n: p.detach().clone() for n, p in model.backbone.named_parameters()}
    after_first_epoch = {}

    class Watch(pl.Callback):
        def on_train_epoch_end(self, trainer, pl_module):
            if trainer.current_epoch == 0:
                after_first_epoch.update({n: p.detach().clone() for n, p in pl_module.backbone.named_parameters()})

    trainer = pl.Trainer(accelerator="cpu", devices=1, max_epochs=2, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=[unfreeze(), Watch()])
    trainer.fit(model)
    muon, adamw = (o.optimizer for o in model.optimizers())
    groups = [{g["name"]: (list(g["param_names"]), g["lr"]) for g in o.param_groups} for o in (muon, adamw)]
    # by the same rules as at the start: backbone.0 reads the batch (the first batch saw it, frozen): an input layer
    assert groups[0]["unfrozen_1"] == (["backbone.3.weight"], pytest.approx(0.02 / 10))
    assert groups[1]["unfrozen_1"] == (["backbone.0.weight", "backbone.0.bias", "backbone.1.weight",
                                        "backbone.1.bias", "backbone.3.bias"], pytest.approx(3e-4 / 10))
    assert all(torch.equal(after_first_epoch[n], p) for n, p in frozen.items())  # frozen through epoch 0
    assert all(not torch.equal(model.backbone.get_parameter(n), p) for n, p in frozen.items())  # then trained
    assert muon.state[model.backbone[3].weight] and adamw.state[model.backbone[0].weight]  # stepped, fresh
    assert trainer.global_step == 8


# ------------------------------------------------------------------ BackboneFinetuning, resumes


def quiet_trainer(pl, root, callbacks, max_epochs=3, **kwargs):
    """A quiet CPU Trainer of package ``pl`` saving a checkpoint at the end of every epoch (``epoch=<n>.ckpt``)."""
    checkpoints = pl.callbacks.ModelCheckpoint(dirpath=root, filename="{epoch}", save_top_k=-1, every_n_epochs=1)
    return pl.Trainer(accelerator="cpu", devices=1, max_epochs=max_epochs, logger=False, enable_progress_bar=False,
                      enable_model_summary=False, default_root_dir=root, callbacks=[*callbacks, checkpoints], **kwargs)


def groups_at_batches(pl):
    """A callback of package ``pl`` recording, at every batch start, each optimizer's groups as
    ``(name, lr, parameter names)``: ``.epochs[epoch]`` is the list of those records, one per batch."""

    class Groups(pl.Callback):
        def __init__(self):
            self.epochs = {}

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self.epochs.setdefault(trainer.current_epoch, []).append(
                [[(g["name"], g["lr"], list(g["param_names"])) for g in o.param_groups] for o in trainer.optimizers])

    return Groups()


def expected_backbone_lrs(lrs_at, unfreeze_at, ratio, factor):
    """BackboneFinetuning's formula for ONE optimizer, as Lightning computes it: ``lrs_at[epoch]`` is that optimizer's
    lr (its first group's) at the epoch's start; the backbone's lr at each epoch from the unfreeze on."""
    backbone = {unfreeze_at: lrs_at[unfreeze_at] * ratio}
    for epoch in range(unfreeze_at + 1, max(lrs_at) + 1):
        backbone[epoch] = min(factor * backbone[epoch - 1], lrs_at[epoch])  # should_align caps it at the lr
    return backbone


def backbone_lrs_seen(groups, index):
    """Optimizer ``index``'s (first group lr, last group lr) at each epoch's first batch."""
    return {e: (batches[0][index][0][1], batches[0][index][-1][1]) for e, batches in groups.epochs.items()}


BACKBONE_MATRICES = ["backbone.3.weight"]  # backbone.0 reads the batch: an input layer, on AdamW
BACKBONE_REST = ["backbone.0.weight", "backbone.0.bias", "backbone.1.weight", "backbone.1.bias", "backbone.3.bias"]


class SaveAtSteps(L.Callback):
    """Saves ``step=<n>.ckpt`` after the updates ``steps`` (within an epoch)."""

    def __init__(self, root, steps):
        self.root, self.steps = root, steps

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step in self.steps:
            trainer.save_checkpoint(self.root / f"step={trainer.global_step}.ckpt")


@pytest.fixture(scope="module")
def backbone_run(tmp_path_factory):
    """The uninterrupted run: backbone and head only, BackboneFinetuning(unfreeze_backbone_at_epoch=1) (its
    defaults: 0.1 of the lr, then x2 an epoch), 3 epochs of 4 updates, a checkpoint after each epoch and after
    updates 6 and 10 (within epochs 1 and 2); with the recorded groups, the backbone after epoch 0 and the final
    weights."""
    root = tmp_path_factory.mktemp("backbone")
    module_class, _ = finetuning_classes(L.pytorch, mix=False)
    model = module_class()
    groups = groups_at_batches(L.pytorch)
    frozen = snapshot(model.backbone)
    quiet_trainer(L.pytorch, root, [MuonBackboneFinetuning(unfreeze_backbone_at_epoch=1),
                                    groups, SaveAtSteps(root, {6, 10})]).fit(model)
    return {"root": root, "class": module_class, "groups": groups, "frozen": frozen, "final": snapshot(model),
            "model": model}


def test_backbone_finetuning_gives_each_optimizer_its_own_backbone_lr(backbone_run):
    groups, model = backbone_run["groups"], backbone_run["model"]
    muon, adamw = groups.epochs[2][0]
    # Muon had nothing to train before the unfreeze: it held an empty group, its lr BackboneFinetuning's base
    assert groups.epochs[0][0][0] == [("hidden", 0.02, [])]
    assert muon[0] == ("hidden", 0.02, []) and muon[-1][0::2] == ("unfrozen_1", BACKBONE_MATRICES)
    assert adamw[0] == ("head", 3e-4, ["head.weight", "head.bias"]) and adamw[-1][0::2] == ("unfrozen_1", BACKBONE_REST)
    for index, lr in ((0, 0.02), (1, 3e-4)):
        seen = backbone_lrs_seen(groups, index)
        expected = expected_backbone_lrs({e: seen[e][0] for e in seen}, unfreeze_at=1, ratio=0.1, factor=2.0)
        assert {e: seen[e][1] for e in (1, 2)} == expected == {1: lr * 0.1, 2: 2.0 * (lr * 0.1)}  # exactly
    # frozen through epoch 0 (the checkpoint after it holds the initial backbone), trained from epoch 1 on
    after_epoch_0 = torch.load(backbone_run["root"] / "epoch=0.ckpt", weights_only=True)["state_dict"]
    assert all(torch.equal(after_epoch_0[f"backbone.{n}"], p) for n, p in backbone_run["frozen"].items())
    assert all(not torch.equal(model.backbone.get_parameter(n), p) for n, p in backbone_run["frozen"].items())
    assert all(p.requires_grad for p in model.backbone.parameters())


@pytest.mark.parametrize("epoch", [pytest.param(1, id="after-the-unfreeze"), pytest.param(0, id="before-it")])
def test_backbone_finetuning_resumes_bit_identical_to_the_uninterrupted_run(backbone_run, tmp_path, epoch):
    model, groups = backbone_run["class"](), groups_at_batches(L.pytorch)
    callbacks = [MuonBackboneFinetuning(unfreeze_backbone_at_epoch=1), groups]
    quiet_trainer(L.pytorch, tmp_path, callbacks).fit(model, ckpt_path=backbone_run["root"] / f"epoch={epoch}.ckpt")
    assert same(snapshot(model), backbone_run["final"])
    assert {e: batches for e, batches in groups.epochs.items()} == {
        e: batches for e, batches in backbone_run["groups"].epochs.items() if e > epoch}


@pytest.mark.parametrize("step", [pytest.param(6, id="in-the-unfreeze-epoch"), pytest.param(10, id="in-a-later-one")])
def test_a_resume_within_an_epoch_keeps_each_backbone_lr_and_trains_the_backbone(backbone_run, tmp_path, step):
    """Resumed within an epoch: the unfreeze is not done twice and the backbone lrs do not grow twice (Lightning
    2.6 does not run that epoch's on_train_epoch_start again; earlier releases did, and the mixin then skips
    BackboneFinetuning's). The weights are not compared: Lightning replays the epoch's remaining updates on its
    first batches when the dataloader cannot resume, and says so."""
    model, groups = backbone_run["class"](), groups_at_batches(L.pytorch)
    callbacks = [MuonBackboneFinetuning(unfreeze_backbone_at_epoch=1), groups]
    with pytest.warns(UserWarning, match="dataloader is not resumable"):
        quiet_trainer(L.pytorch, tmp_path, callbacks).fit(model, ckpt_path=backbone_run["root"] / f"step={step}.ckpt")
    epoch = step // 4
    assert groups.epochs == {e: batches[-len(groups.epochs[e]):] for e, batches in backbone_run["groups"].epochs.items()
                             if e >= epoch}
    assert all(p.requires_grad for p in model.backbone.parameters())
    assert all(not torch.equal(model.backbone.get_parameter(n), p) for n, p in backbone_run["frozen"].items())


@pytest.mark.parametrize(
    ("callbacks", "error"),
    [
        pytest.param(lambda unfreeze: [], r"groups \['unfrozen_1'\] were added during the fit by a finetuning "
                     r"callback(.|\n)*resume with the finetuning callback the checkpoint was trained with",
                     id="no-callback"),
        pytest.param(lambda unfreeze: [unfreeze()], r"finetuning callback unfroze 6 parameter\(s\)(.|\n)*"
                     r"backbone.0.bias(.|\n)*Resume with the finetuning callback the checkpoint was trained with",
                     id="another-finetuning-callback"),
    ],
)
def test_a_resume_after_an_unfreeze_without_its_finetuning_callback_is_refused_naming_the_fix(
        backbone_run, tmp_path, callbacks, error):
    module_class, unfreeze = finetuning_classes(L.pytorch, mix=False)
    with pytest.raises(Exception, match=error):
        quiet_trainer(L.pytorch, tmp_path, callbacks(unfreeze)).fit(
            module_class(), ckpt_path=backbone_run["root"] / "epoch=1.ckpt")


def test_backbone_finetuning_under_pytorch_lightning_caps_each_backbone_lr_at_its_own_optimizers(tmp_path):
    """The standalone package, a schedule on both optimizers (the backbone groups keep the callback's lr) and
    should_align reached at epoch 2: each backbone lr capped at its own optimizer's lr, not at AdamW's."""
    import pytorch_lightning as pl

    module_class, _ = finetuning_classes(pl, mix=False)
    model = module_class(lr_scheduler=functools.partial(WarmupCosine, warmup_steps=2, min_lr_ratio=0.5))
    groups = groups_at_batches(pl)
    callback = MuonBackboneFinetuning(unfreeze_backbone_at_epoch=1, backbone_initial_ratio_lr=0.5,
                                               lambda_func=lambda epoch: 3.0)
    quiet_trainer(pl, tmp_path, [callback, groups]).fit(model)
    for index in (0, 1):
        seen = backbone_lrs_seen(groups, index)
        expected = expected_backbone_lrs({e: seen[e][0] for e in seen}, unfreeze_at=1, ratio=0.5, factor=3.0)
        assert {e: seen[e][1] for e in (1, 2)} == expected
        assert expected[2] == seen[2][0] < 3.0 * expected[1]  # aligned with this optimizer's (scheduled) lr
        within = [batch[index][-1][1] for batch in groups.epochs[2]]
        assert len(set(within)) == 1 and len({batch[index][0][1] for batch in groups.epochs[2]}) > 1


def test_a_basefinetuning_subclass_resumes_bit_identical_after_its_unfreeze(tmp_path):
    """Lightning's documented pattern (finetune_function offers the backbone to every optimizer) under the
    standalone package: AdamW's group, added during Muon's call, is given back too, and trains."""
    import pytorch_lightning as pl

    module_class, unfreeze = finetuning_classes(pl)
    straight = module_class()
    quiet_trainer(pl, tmp_path / "straight", [unfreeze()]).fit(straight)
    resumed = module_class()
    quiet_trainer(pl, tmp_path / "resumed", [unfreeze()]).fit(resumed, ckpt_path=tmp_path / "straight" / "epoch=1.ckpt")
    assert same(snapshot(resumed), snapshot(straight))
    muon, adamw = (o.optimizer for o in resumed.optimizers())
    assert [g["name"] for g in muon.param_groups] == ["hidden", "unfrozen_1"]
    assert adamw.param_groups[-1]["param_names"] == BACKBONE_REST and adamw.state[resumed.backbone[1].weight]


def test_an_unfreeze_before_the_first_batch_keeps_its_groups_through_the_first_batch_routing(tmp_path):
    """Unfrozen at epoch 0, before the first batch shows the input layer: the batch moves backbone.0.weight within
    the unfrozen groups (Muon's to AdamW's), and the next epoch's lr still lands on the backbone groups. The
    callback comes from the module's configure_callbacks (seen when the fit builds both optimizers)."""
    module_class, _ = finetuning_classes(L.pytorch, mix=False, own_callbacks=lambda: [
        MuonBackboneFinetuning(unfreeze_backbone_at_epoch=0)])
    groups = groups_at_batches(L.pytorch)
    quiet_trainer(L.pytorch, tmp_path, [groups], max_epochs=2).fit(module_class())
    muon, adamw = groups.epochs[1][0]
    assert muon == [("hidden", 0.02, []), ("unfrozen_1", 2.0 * (0.02 * 0.1), BACKBONE_MATRICES)]
    assert adamw == [("head", 3e-4, ["head.weight", "head.bias"]), ("unfrozen_1", 2.0 * (3e-4 * 0.1), BACKBONE_REST)]


def test_a_backbone_with_nothing_to_unfreeze_stops_the_fit_rather_than_rescale_another_group(tmp_path):
    """A backbone of BatchNorm alone trains from the start (train_bn): the unfreeze adds no group, and from the
    next epoch on BackboneFinetuning would set the head's lr (Lightning does so, silently, with one optimizer)."""

    class BatchNormBackbone(MuonMixin, L.LightningModule):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.backbone = torch.nn.BatchNorm1d(8)
            self.hidden, self.head = torch.nn.Linear(8, 8), torch.nn.Linear(8, 1)

        def training_step(self, batch, batch_idx):
            return self.head(torch.tanh(self.hidden(self.backbone(batch[0])))).square().mean()

        def train_dataloader(self):
            return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8, 8)), batch_size=4)

    callback = MuonBackboneFinetuning(unfreeze_backbone_at_epoch=1)
    with pytest.raises(Exception, match=r"at epoch 1 gave optimizer 0 the param groups \[\](.|\n)*pl_module\.backbone"):
        quiet_trainer(L.pytorch, tmp_path, [callback], max_epochs=2).fit(BatchNormBackbone())


@pytest.mark.parametrize(
    ("callback", "error"),
    [
        pytest.param({"backbone_initial_lr": 1e-3},
                     r"BackboneFinetuning\(backbone_initial_lr=0.001\)(.|\n)*backbone_initial_ratio_lr",
                     id="one-absolute-backbone-lr"),
    ],
)
def test_backbone_finetuning_settings_that_cannot_hold_for_two_optimizers_are_refused_before_any_update(
        tmp_path, callback, error):
    module_class, _ = finetuning_classes(L.pytorch)
    model = module_class()
    before = snapshot(model)
    with pytest.raises(Exception, match=error):
        make_trainer(tmp_path, max_epochs=2, callbacks=[MuonBackboneFinetuning(**callback)]).fit(model)
    assert same(snapshot(model), before)
    # the AdamW baseline takes it as it is
    make_trainer(tmp_path, max_epochs=2, callbacks=[MuonBackboneFinetuning(**callback)]).fit(
        module_class(muon=None))


def test_an_added_groups_other_settings_go_to_the_optimizers_that_have_them(tmp_path):
    """A group offered with its own weight decay and betas: both optimizers' parts keep the weight decay, AdamW's
    the betas (Muon has none), and a key no optimizer knows stays in both groups, as torch keeps it."""
    module_class, _ = finetuning_classes(L.pytorch)

    class UnfreezeWithSettings(BaseFinetuning):
        def freeze_before_training(self, pl_module):
            self.freeze(pl_module.backbone)

        def finetune_function(self, pl_module, current_epoch, optimizer):
            if current_epoch == 1:
                self.make_trainable(pl_module.backbone)
                optimizer.add_param_group({"params": list(pl_module.backbone.parameters()), "lr": 1e-3,
                                           "weight_decay": 0.0, "betas": (0.5, 0.6), "note": "backbone"})

    model = module_class()
    trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=2, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[UnfreezeWithSettings()])
    trainer.fit(model)
    muon, adamw = (o.optimizer for o in model.optimizers())
    (muon_added,) = (g for g in muon.param_groups if g["name"] == "unfrozen_1")
    (adamw_added,) = (g for g in adamw.param_groups if g["name"] == "unfrozen_1")
    assert muon_added["param_names"] == ["backbone.3.weight"] and len(adamw_added["param_names"]) == 5
    assert muon_added["weight_decay"] == 0.0 and adamw_added["weight_decay"] == 0.0  # not the optimizers' defaults
    assert adamw_added["betas"] == (0.5, 0.6) and "betas" not in muon_added
    assert muon_added["note"] == adamw_added["note"] == "backbone"
    assert muon.defaults["weight_decay"] != 0.0 and adamw.defaults["betas"] != (0.5, 0.6)  # the test can fail
