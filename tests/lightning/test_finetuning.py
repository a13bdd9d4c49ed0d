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
