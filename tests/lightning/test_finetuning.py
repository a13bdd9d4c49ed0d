"""Fine-tuning under MuonMixin, through a real Trainer: PEFT LoRA on a transformers Llama with the mixin's
defaults (every trainable tensor is a LoRA matrix: Muon alone trains it), the frozen base left bit-identical,
checkpoints that round-trip and resume exactly; and a routing that leaves Muon empty trains and resumes too."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_muon import MuonMixin, MuonMonitor

from helpers import MuonRegression, make_trainer, raw_optimizers, read_metrics, same, snapshot

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")


class LoraLM(L.LightningModule):
    """A tiny random-init Llama wrapped by ``peft.get_peft_model`` (LoRA r=4 on q_proj and v_proj), on fixed
    random tokens: 4 batches an epoch."""

    def __init__(self) -> None:
        super().__init__()
        config = transformers.LlamaConfig(
            vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=16,
        )
        with torch.random.fork_rng():
            torch.manual_seed(0)
            base = transformers.LlamaForCausalLM(config)
            self.model = peft.get_peft_model(base, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))

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


def test_lora_with_the_defaults_trains_only_the_adapters_on_muon_alone(tmp_path, caplog):
    model = MuonLoraLM()
    frozen_before = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    lora_before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    with caplog.at_level("INFO", logger="lightning.pytorch.utilities.rank_zero"):
        make_trainer(tmp_path, max_steps=4, csv_dir=tmp_path, callbacks=[MuonMonitor()]).fit(model)
    assert [r.message for r in caplog.records if "no parameter was routed to AdamW" in r.message]
    (muon,) = raw_optimizers(model)
    names = [n for g in muon.param_groups for n in g["param_names"]]
    assert len(names) == 8 and all(".lora_A." in n or ".lora_B." in n for n in names)
    assert sorted(names) == sorted(lora_before)
    after = dict(model.named_parameters())
    assert all(torch.equal(after[n], p) for n, p in frozen_before.items())  # the base, bit for bit
    assert all(not torch.equal(after[n], p) for n, p in lora_before.items())  # every adapter trained
    logged = read_metrics(tmp_path)
    assert sum(1 for row in logged if row.get("lr-Muon/hidden")) == 4
    assert not [k for k in logged[0] if k.startswith("lr-AdamW")]


def test_a_lora_checkpoint_loads_back_and_resumes_exactly(tmp_path):
    straight = two_epochs(tmp_path / "straight", MuonLoraLM())
    path = tmp_path / "straight" / "epoch=1.ckpt"
    loaded = MuonLoraLM.load_from_checkpoint(path, weights_only=True)
    assert same(snapshot(loaded), straight)
    assert LoraLM.load_from_checkpoint(path, weights_only=True).state_dict().keys() == loaded.state_dict().keys()
    resumed = MuonLoraLM()
    final = two_epochs(tmp_path / "resumed", resumed, ckpt_path=tmp_path / "straight" / "epoch=0.ckpt")
    assert same(final, straight)
    assert len(raw_optimizers(resumed)) == 1


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


def finetuning_classes(pl):
    """A module of package ``pl`` with a ``backbone`` (Linear, LayerNorm, Linear) and a head, and a BaseFinetuning
    of that package that freezes the backbone and unfreezes it at epoch 1 (Lightning's documented pattern)."""

    class WithBackbone(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            with torch.random.fork_rng():
                torch.manual_seed(0)
                self.backbone = torch.nn.Sequential(
                    torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Tanh(), torch.nn.Linear(16, 16))
                self.mix = torch.nn.Linear(16, 16)
                self.head = torch.nn.Linear(16, 1)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return torch.nn.functional.mse_loss(self.head(torch.tanh(self.mix(torch.tanh(self.backbone(x))))), y)

        def train_dataloader(self):
            x = torch.randn(16, 8, generator=torch.Generator().manual_seed(0))
            return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True).sin()),
                                               batch_size=4)

    class Unfreeze(pl.callbacks.BaseFinetuning):
        def freeze_before_training(self, pl_module):
            self.freeze(pl_module.backbone)

        def finetune_function(self, pl_module, current_epoch, optimizer):
            if current_epoch == 1:
                self.unfreeze_and_add_param_group(modules=pl_module.backbone, optimizer=optimizer)

    return type("MuonWithBackbone", (MuonMixin, WithBackbone), {}), Unfreeze


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


def test_backbone_finetuning_is_refused_before_any_update_with_the_way_out(tmp_path):
    from lightning.pytorch.callbacks import BackboneFinetuning

    module_class, _ = finetuning_classes(L.pytorch)
    model = module_class()
    before = snapshot(model)
    with pytest.raises(Exception, match=r"BackboneFinetuning keeps one backbone learning rate(.|\n)*BaseFinetuning"):
        make_trainer(tmp_path, max_epochs=2, callbacks=[BackboneFinetuning(unfreeze_backbone_at_epoch=1)]).fit(model)
    assert same(snapshot(model), before)
    # the AdamW baseline takes it as it is
    make_trainer(tmp_path, max_epochs=2, callbacks=[BackboneFinetuning(unfreeze_backbone_at_epoch=1)]).fit(
        module_class(muon=None))


def test_a_resume_after_an_unfreeze_is_refused_saying_so(tmp_path):
    module_class, unfreeze = finetuning_classes(L.pytorch)
    checkpoints = ModelCheckpoint(dirpath=tmp_path, filename="{epoch}", save_top_k=-1, every_n_epochs=1)
    make_trainer(tmp_path, max_epochs=2, enable_checkpointing=True, callbacks=[unfreeze(), checkpoints]).fit(
        module_class())
    with pytest.raises(Exception, match=r"backbone.0.weight: trainable in the checkpoint, frozen in this model"):
        make_trainer(tmp_path, max_epochs=3, callbacks=[unfreeze()]).fit(module_class(),
                                                                          ckpt_path=tmp_path / "epoch=1.ckpt")
